"""`shardtune init-model`: a Hugging Face model directory with random weights, no hub needed."""

from __future__ import annotations

from pathlib import Path

import torch

from shardtune.errors import ShardtuneError
from shardtune.fileio import write_safetensors
from shardtune.models.build import build_on_meta, write_config
from shardtune.models.presets import PRESETS, preset_config
from shardtune.models.tokenizer import load_tokenizer
from shardtune.models.weights import RandomInitSource

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def init_model(out_dir: Path, preset: str, *, config_only: bool = False, seed: int = 0, dtype: str = "fp32",
               max_shard_bytes: int = 5 * 10**9) -> Path:
    """Write config.json, tokenizer files and (unless config_only) random-init safetensors.

    The weights equal what `model.preset: NAME` with `model.seed: SEED` trains from on a CPU.
    Tensors are drawn and written one shard at a time, so an 8B model needs one shard of RAM.
    """
    if preset not in PRESETS:
        raise ShardtuneError(f"--preset {preset!r} is not a preset; choose one of {', '.join(PRESETS)}")
    hf_config = preset_config(preset)
    model = build_on_meta(hf_config)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_config(model, hf_config, load_tokenizer(None), out_dir, DTYPES[dtype])
    if config_only:
        return out_dir
    source = RandomInitSource(hf_config.initializer_range, seed)
    params = dict(model.named_parameters())  # tied weights appear once, as transformers saves them
    sizes = [(n, p.numel() * DTYPES[dtype].itemsize) for n, p in params.items()]
    write_safetensors(out_dir, sizes, lambda n: source.full(n, params[n].shape).to(DTYPES[dtype]), max_shard_bytes)
    return out_dir
