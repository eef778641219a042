"""The model a run trains, assembled on the meta device in one place (shardtune.assemble)."""

from __future__ import annotations

import pytest
import torch

from shardtune.assemble import assemble
from shardtune.config import ModelConfig, ParallelConfig, PeftConfig
from shardtune.models.presets import preset_config
from shardtune.parallel import BACKENDS

HF = preset_config("tiny-llama")
CPU = torch.device("cpu")


def test_full_fine_tuning_trains_every_parameter():
    built = assemble(ModelConfig(preset="tiny-llama"), PeftConfig(), "bf16", HF, CPU, 1)
    assert not built.adapters and built.model is built.base
    assert built.trainable == built.params == sum(p.numel() for p in built.base.parameters())
    assert len(built.blocks) == HF.num_hidden_layers
    assert all(p.is_meta and p.dtype == torch.float32 for p in built.model.parameters())


def test_lora_adds_adapters_on_a_frozen_base_in_the_compute_dtype():
    built = assemble(ModelConfig(preset="tiny-llama"), PeftConfig(method="lora", r=4), "bf16", HF, CPU, 1)
    assert built.adapters
    trainable = {n: p for n, p in built.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
    assert built.trainable == sum(p.numel() for p in trainable.values()) < built.params
    assert all(p.dtype == torch.bfloat16 for p in built.model.parameters() if not p.requires_grad)
    name = next(iter(trainable))
    assert built.source.rows(name, trainable[name].shape, 0, 1).shape[0] == 1  # adapters drawn per name


@pytest.mark.parametrize("strategy, world, shard_world", [("ddp", 16, 8), ("zero3", 16, 16), ("zero3", 2, 8)])
def test_qlora_sizes_nf4_blocks_for_the_backends_parameter_shards(strategy, world, shard_world):
    pytest.importorskip("torchao")
    from shardtune.peft.qlora import is_nf4, nf4_scaler_block_size

    shards = BACKENDS["fsdp2"].param_shards(ParallelConfig(strategy=strategy), world)
    built = assemble(ModelConfig(preset="tiny-llama"), PeftConfig(method="qlora", r=4), "fp32", HF, CPU, shards)
    nf4 = {n: p for n, p in built.model.named_parameters() if is_nf4(p)}
    assert nf4
    for p in nf4.values():
        assert p.scaler_block_size == nf4_scaler_block_size(p.shape, shard_world)
