"""Host time per call of a compiled decoder block, with and without LoRA, and what skipping Dynamo's guard checks
saves (issue 17: 8B LoRA steps wait on the host's launches; bench/RESULTS.md, nineteenth session). A tiny Llama
(4 blocks, hidden 64) on CPU under no_grad, so the time is mostly host overhead, not compute.

    python bench/probe_host_overhead.py   (CPU, ~1 minute; torch 2.13: with LoRA 205 us a block call, 157 without
                                           guard checks; without LoRA 138 / 115)
"""

from __future__ import annotations

import statistics
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

CFG = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(lora: bool) -> torch.nn.Module:
    model = LlamaForCausalLM(CFG)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    return model


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]


def us_per_block(model: torch.nn.Module, x: torch.Tensor, reps: int = 200) -> float:
    layers = blocks(model)
    inner = model.get_base_model().model if hasattr(model, "get_base_model") else model.model
    pos = torch.arange(x.shape[1])[None]
    emb = inner.rotary_emb(x, pos)

    def run() -> None:
        h = x
        for layer in layers:
            h = layer(h, position_embeddings=emb, position_ids=pos)
            h = h[0] if isinstance(h, tuple) else h

    for _ in range(5):
        run()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / len(layers) * 1e6


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 8, 64)
    with torch.no_grad():
        for lora in (False, True):
            model = build(lora)
            eager = us_per_block(model, x)
            for layer in blocks(model):
                layer.compile()
            compiled = us_per_block(model, x)
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                unguarded = us_per_block(model, x)
            print(f"LoRA {lora}: eager {eager:.0f} us a block call, compiled {compiled:.0f}, compiled without "
                  f"guard checks {unguarded:.0f}")


if __name__ == "__main__":
    main()
