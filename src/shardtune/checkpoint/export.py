"""`shardtune export`: a resumable checkpoint -> a Hugging Face model directory, in one process.

Tensors are read one at a time from the DCP shards (whatever world size wrote them), or for a
checkpoint of the deepspeed backend (manifest "format": "deepspeed") assembled one at a time from
the ranks' fp32 optimizer partitions (checkpoint/deepspeed_files.py), and written into safetensors
files as they come, so host memory holds one tensor plus one output shard, never the model. No
process group is needed.
"""

from __future__ import annotations

import functools
import json
import math
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from shardtune.checkpoint.dcp import SafeReader, load_state, read_manifest, read_trainer_state, resolve_checkpoint
from shardtune.checkpoint.deepspeed_files import LazyTensor, deepspeed_model_tensors
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


def checkpoint_format(path: Path) -> str:
    """How a complete checkpoint stores its tensors: "dcp" (the fsdp2 backend; manifests before the
    deepspeed backend carry no format) or "deepspeed"."""
    fmt = (read_manifest(path) or {}).get("format", "dcp")
    if fmt not in ("dcp", "deepspeed"):
        raise ShardtuneError(f"{path}: checkpoint format {fmt!r} is not one this shardtune reads (dcp, deepspeed)")
    return fmt


def checkpoint_tensors(path: Path) -> dict[str, LazyTensor]:
    """Parameter name -> LazyTensor (shape, dtype, load()) of the model in a checkpoint of either format."""
    if checkpoint_format(path) == "deepspeed":
        return deepspeed_model_tensors(path)
    return {name: LazyTensor(tuple(meta.size), meta.properties.dtype,
                             functools.partial(read_tensor, path, MODEL_PREFIX + name, meta))
            for name, meta in model_tensors(path).items()}


def export_checkpoint(checkpoint: str, out_dir: str | Path, *, dtype: str = "auto",
                      max_shard_bytes: int = 5 * 10**9, merge_lora: bool = False) -> Path:
    """Write checkpoint (a step directory, or a run directory: its newest checkpoint) as an HF model
    directory; a LoRA checkpoint as a PEFT adapter directory, or with merge_lora as a merged model."""
    from transformers import AutoConfig, AutoTokenizer

    path = resolve_checkpoint(checkpoint)
    assert path is not None
    hf_dir = path / "hf"
    if not (hf_dir / "config.json").is_file():
        raise ShardtuneError(f"{path}: no hf/config.json in the checkpoint; it was not written by shardtune")
    lora = (hf_dir / "adapter_config.json").is_file()
    if merge_lora and not lora:
        raise ShardtuneError(f"--merge-lora: {path} is a full fine-tuning checkpoint (no LoRA adapter)")
    if lora and not merge_lora:
        return export_adapter(path, Path(out_dir))
    hf_config = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    if dtype == "auto":
        precision = read_trainer_state(path).get("config", {}).get("train", {}).get("precision", "bf16")
        dtype = "fp32" if precision == "fp32" else "bf16"
    target = SAVE_DTYPES[dtype]
    if lora:
        return export_merged(path, Path(out_dir), hf_config, tokenizer, target, max_shard_bytes)
    tensors = checkpoint_tensors(path)
    if getattr(hf_config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)  # tied to the input embedding: saved once, as transformers does
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    def fetch(name: str) -> torch.Tensor:
        t = tensors[name].load()
        return t.to(target) if t.is_floating_point() else t

    sizes = [(n, t.numel * (target.itemsize if t.dtype.is_floating_point else t.dtype.itemsize))
             for n, t in tensors.items()]
    write_safetensors(tmp, sizes, fetch, max_shard_bytes)
    write_config(hf_config.architectures[0] if hf_config.architectures else None, hf_config, tokenizer, tmp, target)
    replace_dir(tmp, out)
    return out


_ADAPTER_NAME = re.compile(r"\.default(?=\.weight$|$)")


def export_adapter(path: Path, out: Path) -> Path:
    """A LoRA checkpoint -> a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)."""
    from safetensors.torch import save_file

    tensors = checkpoint_tensors(path)
    state = {_ADAPTER_NAME.sub("", name): t.load().float().contiguous() for name, t in tensors.items()}
    if not state:
        raise ShardtuneError(f"{path}: the checkpoint holds no adapter tensors")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    for f in (path / "hf").iterdir():
        if f.name.startswith(("adapter_config", "tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, tmp / f.name)
    replace_dir(tmp, out)
    return out


def export_merged(path: Path, out: Path, hf_config: Any, tokenizer: Any, target: torch.dtype,
                  max_shard_bytes: int) -> Path:
    """Base weights (re-read from the run's model.path or preset) + scale * B @ A, tensor by tensor."""
    from shardtune.config import ModelConfig
    from shardtune.models.build import build_on_meta
    from shardtune.models.weights import make_source

    adapter = json.loads((path / "hf" / "adapter_config.json").read_text())
    if adapter.get("use_dora"):
        raise ShardtuneError("--merge-lora: DoRA adapters are not merged here; export the adapter and use "
                             "peft's merge_and_unload()")
    r = adapter["r"]
    scale = adapter["lora_alpha"] / (math.sqrt(r) if adapter.get("use_rslora") else r)
    trainer = read_trainer_state(path)
    run = trainer.get("config", {})
    source = make_source(ModelConfig(**run.get("model", {})), hf_config, torch.device("cpu"))
    dequantize = _nf4_round_trip(run, trainer) if run.get("peft", {}).get("method") == "qlora" else None
    params = dict(build_on_meta(hf_config).named_parameters())
    lora = checkpoint_tensors(path)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    def fetch(name: str) -> torch.Tensor:
        weight = source.rows(name, params[name].shape, 0, params[name].shape[0]).float()
        module = name.rsplit(".", 1)[0]
        a_key, b_key = (f"base_model.model.{module}.lora_{x}.default.weight" for x in "AB")
        if a_key in lora:
            if dequantize is not None:  # QLoRA trained against the 4-bit weight: merge into that
                weight = dequantize(weight)
            a = lora[a_key].load().float()
            b = lora[b_key].load().float()
            weight = weight + scale * (b @ a)
        return weight.to(target)

    write_safetensors(tmp, [(n, p.numel() * target.itemsize) for n, p in params.items()], fetch, max_shard_bytes)
    write_config(hf_config.architectures[0] if hf_config.architectures else None, hf_config, tokenizer, tmp, target)
    replace_dir(tmp, out)
    return out


def _nf4_round_trip(run: dict[str, Any], trainer: dict[str, Any]) -> Any:
    """The NF4 quantise-dequantise the QLoRA run applied to each base weight (same block sizes)."""
    from shardtune.config import ParallelConfig
    from shardtune.parallel import BACKENDS
    from shardtune.peft.qlora import nf4_round_trip, nf4_shard_world

    parallel = ParallelConfig(**run.get("parallel", {}))
    shards = BACKENDS[parallel.backend].param_shards(parallel, int(trainer.get("world_size", 1)))
    return functools.partial(nf4_round_trip, shard_world=nf4_shard_world(shards))
