"""The model a run trains, assembled on the meta device: the architecture from its config, LoRA adapters
(PEFT) on a frozen base, the base's linear weights as NF4 for QLoRA, the frozen base cast to its storage
dtype, and the facts the rest of the run needs (blocks, weight source, parameter counts).

It sits above `models` (build, facts, weights) and `peft` (LoRA, NF4) and combines them; backends then
shard and load what it returns, and the loop only trains it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardtune.config import ModelConfig, PeftConfig
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
    """

    model: nn.Module
    base: nn.Module
    source: WeightSource
    blocks: list[nn.Module]
    params: int
    trainable: int

    @property
    def adapters(self) -> bool:
        """True when only adapters train on a frozen base (checkpoints then hold the adapters alone)."""
        return self.model is not self.base


def assemble(model_cfg: ModelConfig, peft: PeftConfig, precision: str, hf_config: Any, device: torch.device,
             param_shards: int) -> BuiltModel:
    """Build the model a run names, with its adapters, on the meta device. `param_shards`: over how many
    ranks the backend splits each parameter (QLoRA sizes its NF4 blocks for it); `device`: where a preset's
    random weights are drawn."""
    base = build_on_meta(hf_config, model_cfg.attn_implementation)
    model, source = base, make_source(model_cfg, hf_config, device)
    if peft.method != "none":
        model, source = _with_adapters(base, source, model_cfg.seed, peft, precision, hf_config, param_shards)
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return BuiltModel(model, base, source, decoder_blocks(model, hf_config.model_type), params, trainable)


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
