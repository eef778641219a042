"""`shardtune export`: a resumable checkpoint -> a Hugging Face model directory, in one process.

Tensors are read one at a time from the DCP shards (whatever world size wrote them) and written
into safetensors files as they come, so host memory holds one tensor plus one output shard,
never the model. No process group is needed.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from shardtune.checkpoint.dcp import SafeReader, load_state, read_trainer_state, resolve_checkpoint
from shardtune.checkpoint.hf_export import SAVE_DTYPES, replace_dir, write_config, write_safetensors
from shardtune.errors import ShardtuneError

MODEL_PREFIX = "model."  # the checkpoint's state is {"model": ..., "optim": ...}, flattened by DCP


def model_tensors(path: Path) -> dict[str, Any]:
    """Parameter name -> DCP tensor metadata (shape, dtype) of the model in a checkpoint."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = SafeReader(str(path)).read_metadata()
    return {key[len(MODEL_PREFIX):]: meta for key, meta in metadata.state_dict_metadata.items()
            if key.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)}


def read_tensor(path: Path, key: str, meta: Any) -> torch.Tensor:
    """One full tensor (`key` as DCP names it, e.g. model.lm_head.weight), assembled from however
    many rank shards hold it."""
    tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    with warnings.catch_warnings():  # "no process group: loading in a single process" is the intent
        warnings.simplefilter("ignore", UserWarning)
        load_state({key: tensor}, path, partial=True, no_dist=True)
    return tensor


def export_checkpoint(checkpoint: str, out_dir: str | Path, *, dtype: str = "auto",
                      max_shard_bytes: int = 5 * 10**9) -> Path:
    """Write checkpoint (a step directory, or a run directory: its newest checkpoint) as an HF directory."""
    from transformers import AutoConfig, AutoTokenizer

    path = resolve_checkpoint(checkpoint)
    assert path is not None
    hf_dir = path / "hf"
    if not (hf_dir / "config.json").is_file():
        raise ShardtuneError(f"{path}: no hf/config.json in the checkpoint; it was not written by shardtune")
    hf_config = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    if dtype == "auto":
        precision = read_trainer_state(path).get("config", {}).get("train", {}).get("precision", "bf16")
        dtype = "fp32" if precision == "fp32" else "bf16"
    target = SAVE_DTYPES[dtype]
    tensors = model_tensors(path)
    if getattr(hf_config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)  # tied to the input embedding: saved once, as transformers does
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    def fetch(name: str) -> torch.Tensor:
        t = read_tensor(path, MODEL_PREFIX + name, tensors[name])
        return t.to(target) if t.is_floating_point() else t

    sizes = [(n, _numel(m) * (target.itemsize if m.properties.dtype.is_floating_point else m.properties.dtype.itemsize))
             for n, m in tensors.items()]
    write_safetensors(tmp, sizes, fetch, max_shard_bytes)
    write_config(hf_config.architectures[0] if hf_config.architectures else None, hf_config, tokenizer, tmp, target)
    replace_dir(tmp, out)
    return out


def _numel(meta: Any) -> int:
    n = 1
    for d in meta.size:
        n *= d
    return n
