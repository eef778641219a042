"""Write the trained model as a Hugging Face directory (or its LoRA adapter as a PEFT one), gathered one
tensor at a time.

Every rank takes part in gathering each tensor (DTensor.full_tensor), but only rank 0 keeps it,
and only until the current safetensors shard is written: host memory is bounded by one shard,
not the model. The directory appears under its final name only when complete, and only where it
replaces nothing shardtune did not write (checkpoint/outdir.py).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardtune.checkpoint.outdir import staged
from shardtune.dist import first_problem
from shardtune.errors import ShardtuneError
from shardtune.fileio import disk_full, free_bytes, full_tensor, save_safetensors, size_text, write_safetensors
from shardtune.models.build import write_config

SAVE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (tied ones once, under their first name) and persistent buffers, in module order."""
    out: dict[str, torch.Tensor] = dict(module.named_parameters())
    for mod_name, mod in module.named_modules():
        for buf_name, buf in mod.named_buffers(recurse=False):
            if buf is not None and buf_name not in mod._non_persistent_buffers_set:
                out[f"{mod_name}.{buf_name}" if mod_name else buf_name] = buf
    return out


def _nbytes(t: torch.Tensor, dtype: torch.dtype) -> int:
    target = dtype if t.is_floating_point() else t.dtype
    return t.numel() * target.itemsize


def save_hf_model(module: nn.Module, hf_config: Any, tokenizer: Any, out_dir: str | Path, *,
                  dtype: torch.dtype, max_shard_bytes: int, rank: int,
                  gather: Callable[[torch.Tensor], torch.Tensor] | None = None, source: str = "",
                  overwrite: bool = False) -> None:
    """Collective: every rank must call it. Rank 0 writes `out_dir` (safetensors, config, tokenizer,
    shardtune's marker naming `source`), under the rule of checkpoint/outdir.py (`overwrite`: the user's
    --overwrite).

    `gather` gives a parameter's whole tensor (the backend's `full_tensor`; default: DTensor gather)."""
    gather = gather or full_tensor
    out_dir = Path(out_dir)
    tensors = export_tensors(module)
    # Only rank 0 touches the folder; the rule is checked at the swap, after every rank has joined the
    # gathers (a refusal before them would leave the other ranks waiting in a collective).
    stage = staged(out_dir, "model", source, overwrite=overwrite, check_first=False) if rank == 0 else \
        contextlib.nullcontext(out_dir)

    def fetch(name: str) -> torch.Tensor | None:
        full = gather(tensors[name])  # collective: every rank joins
        if rank != 0:
            return None
        return full.to("cpu", dtype if full.is_floating_point() else full.dtype).contiguous()

    sizes = [(n, _nbytes(t, dtype)) for n, t in tensors.items()]
    needed = sum(size for _, size in sizes)
    # A full disk: refused before the gathers when the model cannot fit, else when a write fails; on every rank.
    problem = first_problem(_space_problem(out_dir, "model", needed) if rank == 0 else None)
    if problem:
        raise ShardtuneError(problem)
    try:
        with stage as tmp:
            write_safetensors(tmp, sizes, fetch, max_shard_bytes)
            if rank == 0:
                write_config(module, hf_config, tokenizer, tmp, dtype)
    except Exception as err:
        if not disk_full(err):
            if dist.is_initialized():
                dist.barrier()
            raise
        problem = _no_space(out_dir, "model", needed)
    problem = first_problem(problem)  # also the barrier every rank ends with
    if problem:
        raise ShardtuneError(problem)


def _space_problem(out_dir: Path, kind: str, needed: int) -> str | None:
    free = free_bytes(out_dir.parent)
    if free is None or free >= needed:
        return None
    return (f"the {kind} was not written: {out_dir.parent} has {size_text(free)} free and the {kind} takes "
            f"{size_text(needed)}; {_SPACE_FIX}")


def _no_space(out_dir: Path, kind: str, needed: int) -> str:
    """The line for a write that failed on a full disk (its staging folder is removed by then)."""
    return (f"the {kind} was not written: no space left on the disk of {out_dir.parent} (the {kind} takes "
            f"{size_text(needed)}, {size_text(free_bytes(out_dir.parent))} free); {_SPACE_FIX}")


_SPACE_FIX = ("free space there, or write it to a larger disk (`shardtune export CHECKPOINT DIR` writes it from a "
              "checkpoint)")


def save_adapter(model: nn.Module, out_dir: Path, base_model: str, tokenizer: Any, rank: int,
                 gather: Callable[[torch.Tensor], torch.Tensor] | None = None, *, source: str = "",
                 overwrite: bool = False, readme: str | None = None) -> None:
    """Collective: write `out_dir` as a PEFT adapter (adapter_config.json + adapter_model.safetensors, and
    `readme` as README.md: what the base is and how to load it), with shardtune's marker naming `source`, under
    the rule of checkpoint/outdir.py (`overwrite`: the user's --overwrite)."""
    from shardtune.peft.lora import adapter_state

    state = adapter_state(model, rank, gather)
    if rank != 0:
        return
    if not state or not all(t.numel() for t in state.values()):
        # The empty-adapter failure users hit with ZeRO-3 + PEFT (peft #2892): never write one.
        raise RuntimeError(f"the adapter state is empty ({len(state or {})} tensors); refusing to save it")
    needed = sum(t.numel() * t.element_size() for t in state.values())
    if problem := _space_problem(Path(out_dir), "adapter", needed):  # rank 0 alone writes: no one to agree with
        raise ShardtuneError(problem)
    try:
        with staged(out_dir, "adapter", source, overwrite=overwrite) as tmp:
            save_safetensors(state, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
            config = model.peft_config["default"]
            config.base_model_name_or_path = base_model
            config.save_pretrained(str(tmp))
            if readme:
                (tmp / "README.md").write_text(readme)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp))
            (tmp / "shardtune.json").write_text(json.dumps({"tensors": len(state),
                                                           "parameters": sum(t.numel() for t in state.values())}))
    except Exception as err:
        if not disk_full(err):
            raise
        raise ShardtuneError(_no_space(Path(out_dir), "adapter", needed)) from None
