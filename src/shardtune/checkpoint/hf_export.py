"""Write the trained model as a Hugging Face directory, gathered one tensor at a time.

Every rank takes part in gathering each tensor (DTensor.full_tensor), but only rank 0 keeps it,
and only until the current safetensors shard is written: host memory is bounded by one shard,
not the model. The directory appears under its final name only when complete, and only where it
replaces nothing shardtune did not write (checkpoint/outdir.py).
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardtune.checkpoint.outdir import staged

SAVE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (tied ones once, under their first name) and persistent buffers, in module order."""
    out: dict[str, torch.Tensor] = dict(module.named_parameters())
    for mod_name, mod in module.named_modules():
        for buf_name, buf in mod.named_buffers(recurse=False):
            if buf is not None and buf_name not in mod._non_persistent_buffers_set:
                out[f"{mod_name}.{buf_name}" if mod_name else buf_name] = buf
    return out


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Split tensors, in order, into files of at most max_bytes (a larger tensor gets its own file)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _nbytes(t: torch.Tensor, dtype: torch.dtype) -> int:
    target = dtype if t.is_floating_point() else t.dtype
    return t.numel() * target.itemsize


def _gather(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


def write_safetensors(out: Path, sizes: list[tuple[str, int]], fetch: Callable[[str], torch.Tensor | None],
                      max_shard_bytes: int) -> None:
    """Write tensors, in order, into safetensors files of at most max_shard_bytes (+ index if several).

    `fetch(name)` gives the CPU tensor to write, or None on a rank that only joins the collectives;
    a rank that gets None for every tensor writes nothing.
    """
    from safetensors.torch import save_file

    shards = plan_shards(sizes, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map: dict[str, str] = {}
    total = 0
    for file, shard in zip(names, shards, strict=True):
        buf = {name: t for name in shard if (t := fetch(name)) is not None}
        if buf:
            save_file(buf, str(out / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(buf, file))
            total += sum(t.numel() * t.element_size() for t in buf.values())
    if weight_map and len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def save_hf_model(module: nn.Module, hf_config: Any, tokenizer: Any, out_dir: str | Path, *,
                  dtype: torch.dtype, max_shard_bytes: int, rank: int,
                  gather: Callable[[torch.Tensor], torch.Tensor] | None = None, source: str = "",
                  overwrite: bool = False) -> None:
    """Collective: every rank must call it. Rank 0 writes `out_dir` (safetensors, config, tokenizer,
    shardtune's marker naming `source`), under the rule of checkpoint/outdir.py (`overwrite`: the user's
    --overwrite).

    `gather` gives a parameter's whole tensor (the backend's `full_tensor`; default: DTensor gather)."""
    gather = gather or _gather
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

    try:
        with stage as tmp:
            write_safetensors(tmp, [(n, _nbytes(t, dtype)) for n, t in tensors.items()], fetch, max_shard_bytes)
            if rank == 0:
                write_config(module, hf_config, tokenizer, tmp, dtype)
    finally:
        if dist.is_initialized():
            dist.barrier()


def write_config(model: nn.Module | str | None, hf_config: Any, tokenizer: Any, out: Path,
                 dtype: torch.dtype) -> None:
    """config.json (with architectures, dtype, special token ids), generation_config.json, tokenizer.

    `model` gives the architecture: a model, its class name, or None to keep the config's."""
    from transformers import GenerationConfig

    cfg = copy.deepcopy(hf_config)
    if model is not None:
        cfg.architectures = [model if isinstance(model, str) else type(model).__name__]
    cfg.dtype = dtype
    cfg.use_cache = True
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(tokenizer, key, None) is not None:
            setattr(cfg, key, getattr(tokenizer, key))
    cfg.save_pretrained(out)
    GenerationConfig.from_model_config(cfg).save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
