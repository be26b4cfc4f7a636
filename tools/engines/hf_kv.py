"""A tiny random-weights Llama in transformers, whose KV cache the SGLang and LMCache rounds
hand to the engine's own storage backend (neither engine's model runner runs on this CPU).

Both rounds of an engine take the same path — prefill of the cached prefix, then the rest of
the prompt, then greedy decoding — so identical tokens mean the prefix's KV came back
bit for bit: round 1 computes the prefix, later rounds load it through the engine.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

LAYERS, KV_HEADS, HEAD_DIM = 8, 4, 64


def build_model(model_dir: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024,
                         num_hidden_layers=LAYERS, num_attention_heads=8,
                         num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=8192, tie_word_embeddings=False,
                         initializer_range=0.2)
    LlamaForCausalLM(config).save_pretrained(model_dir, safe_serialization=True)


def load_model(model_dir: Path):
    from transformers import LlamaForCausalLM

    torch.set_num_threads(2)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


@torch.inference_mode()
def prefill(model, tokens: list[int]):
    """The KV cache of *tokens*, as [2, layers, kv_heads, len, head_dim]."""
    out = model(torch.tensor([tokens]), use_cache=True)
    cache = out.past_key_values
    return torch.stack([torch.stack([layer.keys[0] for layer in cache.layers]),
                        torch.stack([layer.values[0] for layer in cache.layers])])


@torch.inference_mode()
def continue_greedy(model, kv: torch.Tensor, rest: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens after the prefix whose KV is *kv* ([2, layers, heads, len, dim]) and
    the prompt's remaining tokens *rest*."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for i in range(kv.shape[1]):
        cache.update(kv[0, i][None].contiguous(), kv[1, i][None].contiguous(), i)
    start = kv.shape[3]
    ids = torch.tensor([rest])
    out: list[int] = []
    pos = start
    for _ in range(max_tokens):
        positions = torch.arange(pos, pos + ids.shape[1])[None]
        logits = model(ids, past_key_values=cache, position_ids=positions,
                       use_cache=True).logits
        pos += ids.shape[1]
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        ids = torch.tensor([[tok]])
    return out
