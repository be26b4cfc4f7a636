"""One round of llama.cpp (llama-cpp-python) saving and restoring sequence state files.

Runs in the llama.cpp virtual environment (tools/engines/llamacpp.sh makes it).
`--build-model` writes a tiny random-weights Llama GGUF with the `gguf` package (no model hub;
a made-up SentencePiece-style vocabulary: prompts are token ids).

This is what llama-server's slot save/restore does (`--slot-save-path DIR`, POST
/slots/0?action=save|restore): one file per sequence, written by
llama_state_seq_save_file and read back by llama_state_seq_load_file. Round 1 generates
greedily from each prompt and then saves the sequence's state to KV_DIR/slot-<i>.bin; later
rounds restore it into a fresh context and generate again: llama-cpp-python then reuses the
restored tokens ("Llama.generate: N prefix-match hit" in its log) and evaluates only the
prompt's last token.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import io
import json
import random
import re
import sys
import time
from pathlib import Path

MODEL_FILE = "tiny-llama-f32.gguf"
PREFIX_HIT = re.compile(r"Llama\.generate: (\d+) prefix-match hit")


def build_model(model_dir: Path, layers: int) -> None:
    import gguf
    import numpy as np

    rng = np.random.default_rng(0)
    n_vocab, n_embd, n_ff, n_head, n_head_kv = 4096, 512, 1024, 8, 4
    head_dim = n_embd // n_head
    w = gguf.GGUFWriter(str(model_dir / MODEL_FILE), "llama")
    w.add_name("kvfs-tiny-random")
    w.add_context_length(8192)
    w.add_embedding_length(n_embd)
    w.add_block_count(layers)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    # SentencePiece layout: <unk> <s> </s>, the 256 byte tokens, then made-up pieces.
    tokens = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256
    while len(tokens) < n_vocab:
        tokens.append(f"\u2581p{len(tokens)}".encode())
        types.append(gguf.TokenType.NORMAL)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(n_vocab)])
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    w.add_tensor("token_embd.weight", weight(n_vocab, n_embd))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("output.weight", weight(n_vocab, n_embd))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", weight(n_embd, n_embd))
        w.add_tensor(f"blk.{i}.attn_k.weight", weight(n_head_kv * head_dim, n_embd))
        w.add_tensor(f"blk.{i}.attn_v.weight", weight(n_head_kv * head_dim, n_embd))
        w.add_tensor(f"blk.{i}.attn_output.weight", weight(n_embd, n_embd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", weight(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", weight(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", weight(n_embd, n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(1234)
    return [[1] + [rng.randrange(259, vocab) for _ in range(length - 1)] for _ in range(n)]


class Tee(io.TextIOBase):
    """sys.stderr that keeps a copy: llama-cpp-python prints its prefix-match line there."""

    def __init__(self, target) -> None:
        self.target = target
        self.copy = io.StringIO()

    def write(self, s: str) -> int:
        self.copy.write(s)
        return self.target.write(s)

    def flush(self) -> None:
        self.target.flush()


def generate(llm, prompt: list[int], max_tokens: int) -> list[int]:
    out = []
    for tok in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0,
                            reset=True):
        out.append(tok)
        if len(out) == max_tokens:
            break
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--kv-dir", type=Path)
    p.add_argument("--round", type=int)
    p.add_argument("--out", type=Path)
    p.add_argument("--build-model", action="store_true")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    if args.build_model:
        build_model(args.model_dir, args.layers)
        return

    import llama_cpp
    from llama_cpp import Llama

    n_ctx = args.prompt_len + args.max_tokens + 16
    llm = Llama(model_path=str(args.model_dir / MODEL_FILE), n_ctx=n_ctx, n_batch=512,
                n_threads=2, seed=0, verbose=True)
    ctx = llm.ctx
    tokens_buf = (llama_cpp.llama_token * n_ctx)()
    results, hits, restored = [], [], []
    tee = Tee(sys.stderr)
    io = 0.0
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(tee):
        for i, prompt in enumerate(prompts(args.prompts, args.prompt_len, llm.n_vocab())):
            path = str(args.kv_dir / f"slot-{i}.bin").encode()
            llm.reset()
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
            if args.round > 1:
                n_out = ctypes.c_size_t(0)
                t_io = time.perf_counter()
                nbytes = llama_cpp.llama_state_seq_load_file(ctx, path, 0, tokens_buf, n_ctx,
                                                              ctypes.byref(n_out))
                io += time.perf_counter() - t_io
                if nbytes == 0:
                    raise SystemExit(f"llama_state_seq_load_file({path!r}) failed")
                n = n_out.value
                llm.input_ids[:n] = tokens_buf[:n]
                llm.n_tokens = n
                restored.append(n)
            mark = tee.copy.tell()
            results.append(generate(llm, prompt, args.max_tokens))
            m = PREFIX_HIT.search(tee.copy.getvalue()[mark:])
            hits.append(int(m.group(1)) if m else 0)
            if args.round == 1:
                n = llm.n_tokens
                tokens_buf[:n] = [int(t) for t in llm.input_ids[:n]]
                t_io = time.perf_counter()
                if llama_cpp.llama_state_seq_save_file(ctx, path, 0, tokens_buf, n) == 0:
                    raise SystemExit(f"llama_state_seq_save_file({path!r}) failed")
                io += time.perf_counter() - t_io
    seconds = time.perf_counter() - t0
    result = {
        "tokens": results,
        "seconds": round(seconds, 3),
        "io_seconds": round(io, 3),
        "hit": args.round > 1 and all(h >= args.prompt_len - 1 for h in hits),
        "evidence": f"prefix-match hits {hits}" + (f", restored tokens {restored}"
                                                     if restored else ""),
    }
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
