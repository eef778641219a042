"""`shardtune export`: a resumable checkpoint -> a Hugging Face model directory, in one process.

Tensors are read one at a time by the checkpoint's format (formats.py: from the DCP shards, whatever
world size wrote them, or for a checkpoint of the deepspeed backend assembled one at a time from the
ranks' fp32 optimizer partitions, checkpoint/deepspeed_files.py), and written into safetensors
files as they come, so host memory holds one tensor plus one output shard, never the model. No
process group is needed.
"""

from __future__ import annotations

import functools
import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from shardtune.checkpoint.formats import LazyTensor, make_format, stored_format
from shardtune.checkpoint.hf_export import SAVE_DTYPES
from shardtune.checkpoint.layout import read_trainer_state, resolve_checkpoint
from shardtune.checkpoint.outdir import check_output_dir, staged
from shardtune.errors import ShardtuneError
from shardtune.fileio import write_safetensors
from shardtune.models.build import write_config
from shardtune.peft.lora import is_adapter


def checkpoint_tensors(path: Path) -> dict[str, LazyTensor]:
    """Parameter name -> LazyTensor (shape, dtype, load()) of the model in a checkpoint, read by the format
    its manifest names."""
    return make_format(stored_format(path)).tensors(path)


def export_checkpoint(checkpoint: str, out_dir: str | Path, *, dtype: str = "auto",
                      max_shard_bytes: int = 5 * 10**9, merge_lora: bool = False, overwrite: bool = False) -> Path:
    """Write checkpoint (a step directory, or a run directory: its newest checkpoint) as an HF model
    directory; a LoRA checkpoint as a PEFT adapter directory, or with merge_lora as a merged model.
    `out_dir` must be new, empty, or an earlier export of the same kind, unless `overwrite`."""
    from transformers import AutoTokenizer

    from shardtune.models.build import read_hf_config

    path = resolve_checkpoint(checkpoint, check=True)  # every file against the manifest's checksums
    assert path is not None
    hf_dir = path / "hf"
    if not (hf_dir / "config.json").is_file():
        raise ShardtuneError(f"{path}: no hf/config.json in the checkpoint; it was not written by shardtune")
    lora = (hf_dir / "adapter_config.json").is_file()
    if merge_lora and not lora:
        raise ShardtuneError(f"--merge-lora: {path} is a full fine-tuning checkpoint (no LoRA adapter)")
    out = Path(out_dir)
    check_output_dir(out, "adapter" if lora and not merge_lora else "model", overwrite=overwrite)  # before any work
    if lora and not merge_lora:
        return export_adapter(path, out, overwrite=overwrite)
    # A checkpoint's code never runs, whatever its run allowed: its files may come from anyone.
    hint = "shardtune export never runs a checkpoint's code; use the model the run wrote to OUTPUT_DIR/model"
    hf_config = read_hf_config(hf_dir, key="checkpoint", hint=hint)
    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True, trust_remote_code=False)
    except ValueError as err:
        if "custom code" not in str(err):
            raise
        raise ShardtuneError(f"checkpoint: the tokenizer in {str(hf_dir)!r} needs its own Python code; {hint}") \
            from None
    if dtype == "auto":
        precision = read_trainer_state(path).get("config", {}).get("train", {}).get("precision", "bf16")
        dtype = "fp32" if precision == "fp32" else "bf16"
    target = SAVE_DTYPES[dtype]
    if lora:
        return export_merged(path, out, hf_config, tokenizer, target, max_shard_bytes, overwrite=overwrite)
    tensors = checkpoint_tensors(path)
    if getattr(hf_config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)  # tied to the input embedding: saved once, as transformers does

    def fetch(name: str) -> torch.Tensor:
        t = tensors[name].load()
        return t.to(target) if t.is_floating_point() else t

    sizes = [(n, t.numel * (target.itemsize if t.dtype.is_floating_point else t.dtype.itemsize))
             for n, t in tensors.items()]
    with staged(out, "model", str(path), overwrite=overwrite) as tmp:
        write_safetensors(tmp, sizes, fetch, max_shard_bytes)
        write_config(hf_config.architectures[0] if hf_config.architectures else None, hf_config, tokenizer, tmp,
                     target)
    return out


_ADAPTER_NAME = re.compile(r"\.default(?=\.weight$|$)")


def export_adapter(path: Path, out: Path, *, overwrite: bool = False) -> Path:
    """A LoRA checkpoint -> a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)."""
    from shardtune.fileio import save_safetensors

    # Adapter tensors only: FSDP2 checkpoints written before shardtune dropped every name of a frozen
    # parameter also hold the frozen, tied LM head (base_model.model.lm_head.weight), which is no adapter.
    tensors = {name: t for name, t in checkpoint_tensors(path).items() if is_adapter(name)}
    state = {_ADAPTER_NAME.sub("", name): t.load().float().contiguous() for name, t in tensors.items()}
    if not state:
        raise ShardtuneError(f"{path}: the checkpoint holds no adapter tensors")
    with staged(out, "adapter", str(path), overwrite=overwrite) as tmp:
        save_safetensors(state, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
        for f in (path / "hf").iterdir():
            if f.name.startswith(("adapter_config", "tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, tmp / f.name)
        readme = _adapter_readme(path)
        if readme:
            (tmp / "README.md").write_text(readme)
    return out


def _adapter_readme(path: Path) -> str | None:
    """The README.md of an exported adapter: its base, from the run's config in the checkpoint (None for a
    checkpoint without one, e.g. written by hand)."""
    from shardtune.config import ModelConfig
    from shardtune.peft.lora import adapter_base

    try:
        model = read_trainer_state(path).get("config", {}).get("model", {})
        return adapter_base(ModelConfig(**{k: model[k] for k in ("path", "preset", "seed")
                                           if model.get(k) is not None}))[1]
    except (ShardtuneError, ValueError, TypeError):
        return None


def export_merged(path: Path, out: Path, hf_config: Any, tokenizer: Any, target: torch.dtype,
                  max_shard_bytes: int, *, overwrite: bool = False) -> Path:
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

    with staged(out, "model", str(path), overwrite=overwrite) as tmp:
        write_safetensors(tmp, [(n, p.numel() * target.itemsize) for n, p in params.items()], fetch,
                          max_shard_bytes)
        write_config(hf_config.architectures[0] if hf_config.architectures else None, hf_config, tokenizer, tmp,
                     target)
    return out


def _nf4_round_trip(run: dict[str, Any], trainer: dict[str, Any]) -> Any:
    """The NF4 quantise-dequantise the QLoRA run applied to each base weight (same block sizes)."""
    from shardtune.config import ParallelConfig
    from shardtune.parallel import BACKENDS
    from shardtune.peft.qlora import nf4_round_trip, nf4_shard_world

    parallel = ParallelConfig(**run.get("parallel", {}))
    shards = BACKENDS[parallel.backend].param_shards(parallel, int(trainer.get("world_size", 1)))
    return functools.partial(nf4_round_trip, shard_world=nf4_shard_world(shards))
