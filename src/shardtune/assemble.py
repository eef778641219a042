"""The model a run trains, assembled on the meta device: the architecture from its config, LoRA adapters
(PEFT) on a frozen base, the base's linear weights as NF4 for QLoRA, the frozen base cast to its storage
dtype, Liger's kernels and torchao's float8 layers swapped in, and the facts the rest of the run needs (blocks,
weight source, parameter counts).

It sits above `models` (build, facts, weights, Liger, float8) and `peft` (LoRA, NF4) and combines them; backends
then shard and load what it returns (`load_kept` after them: the frozen layers kept as float8 casts), and the
loop only trains it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardtune.config import ModelConfig, PeftConfig
from shardtune.errors import ShardtuneError
from shardtune.models.build import build_on_meta
from shardtune.models.facts import decoder_blocks
from shardtune.models.weights import WeightSource, make_source


@dataclass
class BuiltModel:
    """A model on the meta device and its facts.

    model:     what trains (PEFT-wrapped with adapters); base: the architecture underneath (config, export).
    source:    every parameter's initial values (base weights; adapters drawn per name).
    blocks:    the repeated decoder blocks, the unit of sharding and activation checkpointing.
    params, trainable: parameter counts (the NF4 base counted by its logical size).
    float8_layers: how many Linear layers train through torchao's float8 (train.float8).
    kept:      peft.base_dtype: float8: the frozen float8 layers' weights, out of the model while the backend
               loads it; `load_kept` puts each back as its float8 cast (models/float8.py).
    """

    model: nn.Module
    base: nn.Module
    source: WeightSource
    blocks: list[nn.Module]
    params: int
    trainable: int
    float8_layers: int = 0
    kept: list[Any] = field(default_factory=list)

    @property
    def adapters(self) -> bool:
        """True when only adapters train on a frozen base (checkpoints then hold the adapters alone)."""
        return self.model is not self.base


def assemble(model_cfg: ModelConfig, peft: PeftConfig, precision: str, hf_config: Any, device: torch.device,
             param_shards: int, *, liger_kernels: bool = False, float8: str | None = None,
             keep_float8_base: bool = False) -> BuiltModel:
    """Build the model a run names, with its adapters, on the meta device. `param_shards`: over how many
    ranks the backend splits each parameter (QLoRA sizes its NF4 blocks for it); `device`: where a preset's
    random weights are drawn; `liger_kernels`: swap in Liger's RMSNorm, RoPE and SwiGLU (the fused loss is the
    loop's: it depends on the backend); `float8`: torchao's recipe for the blocks' Linear layers. Both before
    sharding and compile, as Liger and torchtitan do. `keep_float8_base` (peft.keeps_float8_base): LoRA's frozen
    float8 layers' weights taken out, to be kept as their casts (load_kept)."""
    base = build_on_meta(hf_config, model_cfg.attn_implementation)
    model, source = base, make_source(model_cfg, hf_config, device)
    if peft.method != "none":
        model, source = _with_adapters(base, source, model_cfg.seed, peft, precision, hf_config, param_shards)
    if liger_kernels:
        from shardtune.models.liger import apply_liger_kernels

        apply_liger_kernels(base)
    float8_layers = 0
    if float8:
        from shardtune.models.float8 import convert_to_float8

        float8_layers = convert_to_float8(model, float8)
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    blocks = decoder_blocks(model, hf_config.model_type)
    kept = _take_float8_base(model, peft.base_dtype == "float8") if keep_float8_base else []
    return BuiltModel(model, base, source, blocks, params, trainable, float8_layers, kept)


def load_kept(built: BuiltModel, weights: WeightSource | None, device: torch.device) -> int:
    """After the backend loaded the model: read each kept frozen float8 layer's weight from `weights` (the
    built source; None on a resume of full fine-tuning, which keeps none) onto `device`, one layer's bf16 at a
    time, and keep only its float8 cast. Returns how many layers."""
    if not built.kept:
        return 0
    from shardtune.models.float8 import load_frozen_weights

    return load_frozen_weights(built.kept, weights, device)


def _take_float8_base(model: nn.Module, asked: bool) -> list[Any]:
    """The frozen float8 layers' weights, out of the model before the backend loads it; none found is an error
    only where peft.base_dtype: float8 `asked` for them (auto then casts at every pass)."""
    from shardtune.models.float8 import take_frozen_weights

    taken = take_frozen_weights(model)
    if not taken and asked:
        raise ShardtuneError("peft.base_dtype: float8 found no frozen float8 layer to keep as its cast; set "
                             "peft.base_dtype=auto")
    return taken


def _with_adapters(base: nn.Module, source: WeightSource, seed: int, peft: PeftConfig, precision: str,
                   hf_config: Any, param_shards: int) -> tuple[nn.Module, WeightSource]:
    from shardtune.peft.lora import LoraSource, apply_lora, cast_frozen, frozen_dtype

    shapes = {name: p.shape for name, p in base.named_parameters()}
    model = apply_lora(base, peft, hf_config.model_type)
    if peft.method == "qlora":
        from shardtune.peft.qlora import nf4_shard_world, quantize_to_nf4

        # Before sharding: FSDP2 picks NF4's own all-gather when fully_shard sees the parameter.
        quantize_to_nf4(model, lambda name: name.endswith(".base_layer"), shard_world=nf4_shard_world(param_shards))
    cast_frozen(model, frozen_dtype(peft.base_dtype, precision))
    return model, LoraSource(source, seed, shapes)
