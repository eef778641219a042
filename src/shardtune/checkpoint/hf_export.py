"""Write the trained model as a Hugging Face directory, gathered one tensor at a time.

Every rank takes part in gathering each tensor (DTensor.full_tensor), but only rank 0 keeps it,
and only until the current safetensors shard is written: host memory is bounded by one shard,
not the model. The directory appears under its final name only when complete.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardtune.fileio import full_tensor, replace_dir, write_safetensors
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
                  gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """Collective: every rank must call it. Rank 0 writes `out_dir` (safetensors, config, tokenizer).

    `gather` gives a parameter's whole tensor (the backend's `full_tensor`; default: DTensor gather)."""
    gather = gather or full_tensor
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    tensors = export_tensors(module)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)

    def fetch(name: str) -> torch.Tensor | None:
        full = gather(tensors[name])  # collective: every rank joins
        if rank != 0:
            return None
        return full.to("cpu", dtype if full.is_floating_point() else full.dtype).contiguous()

    write_safetensors(tmp, [(n, _nbytes(t, dtype)) for n, t in tensors.items()], fetch, max_shard_bytes)
    if rank == 0:
        write_config(module, hf_config, tokenizer, tmp, dtype)
        replace_dir(tmp, out_dir)
    if dist.is_initialized():
        dist.barrier()
