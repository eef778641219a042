"""What is alive at the forward's end of an 8B LoRA step (issue 17: the peak under parallel.checkpoint_blocks was
0.28-0.32 GiB above the planner's count, calls 134-141). Call 142's answer
(bench/probe_forward_end_2026-12-07_call142.txt): the forward's end within 0.11 GiB of its price, the rest in the
kept blocks' compiled backward (plan/memory.py COMPILED_BACKWARD).

`log.memory_snapshot` cannot record these runs: recording the allocator's history during the recompute of compiled
blocks fails on PyTorch 2.11 (pytorch/pytorch#179536). This probe records everything but the backward passes: from
before the model is built (so the weights, the LoRA states and what each forward keeps have their lines of code),
off inside each `Tensor.backward`, and at the end of step STEP's forward (after the fused loss) it writes the
allocations alive then, summed by the line of code that made them (those made inside a backward have no line), with
the step's peak so far. One process, one GPU, the run in this process (as a torchrun worker of one).

    python3 bench/probe_forward_end.py OUT_DIR [overrides...]
    e.g. OUT_DIR parallel.activation_offload=true parallel.checkpoint_in_compile=true parallel.one_gpu=direct
         parallel.checkpoint_blocks=28
Writes OUT_DIR/forward_end.txt (and forward_end.pickle, PyTorch's memory viewer opens it).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
STEP = 3
ENTRIES = 1_000_000


def overrides(out: Path, data: Path) -> list[str]:
    """Table 2's run as bench/peft_bench.py launches it (8B LoRA r=16, seq 2048, micro-batch 2, compiled blocks, Liger's
    fused loss), STEP steps."""
    return ["model.preset=llama-3-8b", f"data.train_file={data}", "data.eval_fraction=0", "train.seq_len=2048",
            "train.micro_batch_size=2", "train.precision=bf16", f"train.max_steps={STEP}", "log.every=1",
            "log.progress=false", "checkpoint.save_final=false", "checkpoint.at_end=false", "parallel.strategy=zero3",
            "parallel.activation_checkpointing=full", "peft.method=lora", "peft.r=16", "peft.alpha=32",
            f"train.output_dir={out / 'run'}", "parallel.compile=true", "model.liger=loss"]


def record(on: bool) -> None:
    torch.cuda.memory._record_memory_history(enabled="all" if on else None, stacks="python", max_entries=ENTRIES)


def where(block: dict[str, Any]) -> str:
    from shardtune.metrics.memory_snapshot import _where

    return _where(block) if block.get("frames") else "(no line: made inside a backward, or before recording)"


def alive(snapshot: dict[str, Any]) -> dict[str, list[int]]:
    """Bytes and count of the allocated blocks, by the line that made them."""
    by_where: dict[str, list[int]] = {}
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                entry = by_where.setdefault(where(block), [0, 0])
                entry[0] += block["size"]
                entry[1] += 1
    return by_where


def install(out: Path) -> None:
    """The forward-end hook on the model the backend prepares, and backward passes left unrecorded."""
    from shardtune.parallel import fsdp2_engine

    prepare = fsdp2_engine.checkpoint_and_compile
    forwards = [0]

    def start(*_: Any) -> None:
        forwards[0] += 1
        if forwards[0] == STEP:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def end(*_: Any) -> None:
        if forwards[0] != STEP:
            return
        torch.cuda.synchronize()
        now, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        snapshot = torch.cuda.memory._snapshot()
        with (out / "forward_end.pickle").open("wb") as f:
            pickle.dump(snapshot, f)
        gib, mib = 2**30, 2**20
        lines = [f"step {STEP}, forward's end (after the loss): {now / gib:.3f} GiB allocated; the step's peak so far "
                 f"{peak / gib:.3f} GiB", "alive now, by the line that made it:"]
        for line, (size, count) in sorted(alive(snapshot).items(), key=lambda kv: -kv[1][0]):
            if size >= mib:
                lines.append(f"  {size / mib:10.1f} MiB {count:5d} x  {line}")
        (out / "forward_end.txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)

    def checkpoint_and_compile(model: Any, blocks: Any, parallel: Any, device_type: str = "cpu") -> Any:
        model.register_forward_pre_hook(start)
        model.register_forward_hook(end)
        return prepare(model, blocks, parallel, device_type)

    fsdp2_engine.checkpoint_and_compile = checkpoint_and_compile
    backward = torch.Tensor.backward

    def unrecorded_backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        record(False)  # pytorch/pytorch#179536: the compiled recompute fails while recording
        try:
            backward(self, *args, **kwargs)
        finally:
            record(True)

    torch.Tensor.backward = unrecorded_backward


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    data = out / "long.jsonl"
    subprocess.run([sys.executable, str(ROOT / "bench" / "make_long_text.py"), str(data), "--n", "64", "--chars",
                    str(2048 + 256 + 32), "--min-tokens", "2048"], check=True, capture_output=True)
    from shardtune.config import load_config
    from shardtune.plan import auto_keys, auto_overrides
    from shardtune.train.loop import run_training
    from shardtune.validate import validate

    path, given = str(ROOT / "bench" / "bench.yaml"), [*overrides(out, data), *sys.argv[2:]]
    auto = auto_keys(load_config(path, given))
    cfg = validate(path, given, nproc_flag=1, quiet=True)
    worker = [*given, *auto_overrides(cfg, auto)]  # what the launcher hands its workers
    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29517")
    install(out)
    record(True)
    run_training(load_config(path, worker))


if __name__ == "__main__":
    main()
