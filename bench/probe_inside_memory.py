"""Where the checkpoint inside a compiled block costs memory (CPU probe, issue 17's bf16 LoRA bound).

On one H100 the 8B LoRA step with the checkpoint inside each compiled block peaked 0.39 GiB above the checkpoint
around it (17.96 against 17.57 GiB, calls 82 and 84). This builds two decoder blocks of a chosen width (default the
Llama-3-8B shape's) with LoRA r=16 on all projections, bf16 base, adapters cast in their forward (as the one-GPU
direct path runs them), and reports each setting's peak of allocated CPU memory over one step (forward + backward,
after a compiling step) above what the step started with, from the profiler's allocation events. The CPU's
Inductor plans buffers with the same scheduler as on GPUs, so the ordering of the settings is what to read; the
kernels and fusions differ.

    python3 bench/probe_inside_memory.py [--hidden 4096 --ffn 14336 --tokens 1024] [--runs eager,around,inside]
    (also none, and b5 / b3 / b0: no checkpoint, parallel.activation_memory_budget 0.5 / 0.3 / 0; tiled,
    tiled_around, tiled_none and plain_none: parallel.tiled_mlp of --tile tokens, eager / compiled with the
    checkpoint around / without checkpointing, and the last without tiles)
"""

from __future__ import annotations

import argparse
import ast
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import LlamaConfig, LlamaForCausalLM

from shardtune.config import ParallelConfig, PeftConfig
from shardtune.parallel.direct_engine import cast_adapters_in_forward
from shardtune.parallel.prepare import checkpoint_and_compile
from shardtune.peft.lora import apply_lora, cast_frozen

RUNS = {
    "eager": {"compile": False, "activation_checkpointing": "full"},
    "around": {"compile": True, "activation_checkpointing": "full", "checkpoint_in_compile": False},
    "inside": {"compile": True, "activation_checkpointing": "full", "checkpoint_in_compile": True},
    "none": {"compile": True, "activation_checkpointing": "none"},
    # parallel.activation_memory_budget: the partitioner's own recompute (thirty-first session)
    "b5": {"compile": True, "activation_checkpointing": "none", "activation_memory_budget": 0.5},
    "b3": {"compile": True, "activation_checkpointing": "none", "activation_memory_budget": 0.3},
    "b0": {"compile": True, "activation_checkpointing": "none", "activation_memory_budget": 0.0},
    # parallel.tiled_mlp (--tile tokens a tile): eager, and compiled with the checkpoint around (its auto)
    "tiled": {"compile": False, "activation_checkpointing": "full", "tiled_mlp": 0},
    "tiled_around": {"compile": True, "activation_checkpointing": "full", "tiled_mlp": 0},
    "tiled_none": {"compile": False, "activation_checkpointing": "none", "tiled_mlp": 0},
    "plain_none": {"compile": False, "activation_checkpointing": "none"},
}


def build(hidden: int, ffn: int, layers: int, run: str, options: dict, tile: int = 256) -> torch.nn.Module:
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_attention_heads=hidden // 128,
                      num_key_value_heads=max(1, hidden // 512), num_hidden_layers=layers, vocab_size=256,
                      max_position_embeddings=8192, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model.model.rotary_emb.__init__(cfg)  # its inv_freq buffer, lost to to_empty
    model = apply_lora(model, PeftConfig(method="lora", r=16), "llama")
    cast_frozen(model, torch.bfloat16)
    cast_adapters_in_forward(model, torch.bfloat16)
    model.train()
    blocks = list(model.base_model.model.model.layers)
    settings = {**RUNS[run], **({"tiled_mlp": tile} if "tiled_mlp" in RUNS[run] else {})}
    parallel = ParallelConfig(**settings, **({"compile_options": options} if options and settings["compile"] else {}))
    checkpoint_and_compile(model, blocks, parallel, "cpu")
    return model


def step_peak(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, float, float]:
    """(peak bytes above the start, bytes held at the forward's end above the start, seconds) of one step."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        with record_function("backward"):
            loss.backward()
        seconds = time.perf_counter() - start
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    backward_start = next(e.time_range.start for e in events if e.name == "backward")
    held = peak = at_forward_end = 0
    for e in events:
        if e.time_range.start < backward_start:
            at_forward_end = held + e.self_cpu_memory_usage
        held += e.self_cpu_memory_usage
        peak = max(peak, held)
    return peak, at_forward_end, seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--runs", default="eager,around,inside")
    ap.add_argument("--tile", type=int, default=256, help="tokens a tile of the tiled runs")
    ap.add_argument("--options", default="", help="Inductor options for the compiled runs, key=value,...")
    args = ap.parse_args()
    options = {k: ast.literal_eval(v) for k, v in (kv.split("=") for kv in args.options.split(",") if kv)}
    ids = torch.randint(0, 256, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    rows = []
    for run in args.runs.split(","):
        torch._dynamo.reset()
        model = build(args.hidden, args.ffn, args.layers, run, options, args.tile)
        step_peak(model, ids)  # compiles
        model.zero_grad(set_to_none=True)
        peak, fwd, seconds = step_peak(model, ids)
        rows.append((run, peak, fwd, seconds))
        print(f"{run}: peak {peak / 2**20:.1f} MiB, at forward end {fwd / 2**20:.1f} MiB, {seconds:.1f} s", flush=True)
        del model
    per_token = 2 * 2 * args.ffn  # 2 x p x f bytes: the planner's INSIDE_RECOMPUTE term
    print("\n| run | peak MiB | at forward end MiB | peak over eager, in 2pf per token | s |")
    print("|---|---|---|---|---|")
    base = rows[0][1]
    for run, peak, fwd, seconds in rows:
        print(f"| {run} | {peak / 2**20:.1f} | {fwd / 2**20:.1f} | {(peak - base) / (per_token * args.tokens):+.2f} "
              f"| {seconds:.1f} |")


if __name__ == "__main__":
    main()
