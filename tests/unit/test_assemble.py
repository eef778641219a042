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


def test_float8_layers_go_in_on_meta_and_a_float8_base_is_kept_out_until_loaded():
    """train.float8 converts the blocks' Linear layers (LoRA: the frozen base layers only) with the parameter
    counts unchanged; peft.base_dtype: float8 takes those layers' weights out while the backend would load the
    model, and load_kept puts each back as its float8 cast, with the source's values."""
    pytest.importorskip("torchao")
    from shardtune.assemble import load_kept

    lora = PeftConfig(method="lora", r=4)
    plain = assemble(ModelConfig(preset="tiny-llama"), lora, "bf16", HF, CPU, 1)
    built = assemble(ModelConfig(preset="tiny-llama"), lora, "bf16", HF, CPU, 1, float8="tensorwise")
    assert built.float8_layers == 7 * HF.num_hidden_layers and not built.kept
    assert (built.params, built.trainable) == (plain.params, plain.trainable)
    kept = assemble(ModelConfig(preset="tiny-llama"), PeftConfig(method="lora", r=4, base_dtype="float8"), "bf16",
                    HF, CPU, 1, float8="tensorwise", keep_float8_base=True)
    assert len(kept.kept) == kept.float8_layers and kept.params == plain.params
    names = {name for name, _ in kept.model.named_parameters()}
    assert all(name not in names for name, _, _ in kept.kept)  # the backend never sees them
    assert load_kept(kept, kept.source, CPU) == kept.float8_layers
    name, module, meta = kept.kept[0]
    assert module.weight_float8_t.shape == meta.shape[::-1]
    want = kept.source.rows(name, meta.shape, 0, meta.shape[0]).to(torch.bfloat16).float()
    got = module.weight_float8_t.to_original_precision().t().float()
    assert torch.allclose(got, want, rtol=0.07, atol=1e-3)  # float8 e4m3 keeps ~2 significant digits


def test_a_float8_base_needs_float8_layers():
    """Asked for (peft.base_dtype: float8) and none to keep: refused; under auto the run casts every pass."""
    from shardtune.errors import ShardtuneError

    with pytest.raises(ShardtuneError, match="found no frozen float8 layer"):
        assemble(ModelConfig(preset="tiny-llama"), PeftConfig(method="lora", r=4, base_dtype="float8"), "bf16", HF,
                 CPU, 1, keep_float8_base=True)
    built = assemble(ModelConfig(preset="tiny-llama"), PeftConfig(method="lora", r=4), "bf16", HF, CPU, 1,
                     keep_float8_base=True)
    assert not built.kept


@pytest.mark.parametrize("overrides, world, keeps", [
    (["train.float8=tensorwise"], 1, True),  # auto, one process: the base is whole
    (["train.float8=tensorwise"], 2, False),  # auto shards the frozen base over two
    (["train.float8=tensorwise", "parallel.shard_frozen=false"], 2, True),
    (["train.float8=tensorwise", "parallel.strategy=ddp"], 1, False),
    (["train.float8=tensorwise", "peft.use_dora=true"], 1, False),
    (["train.float8=tensorwise", "peft.base_dtype=bf16"], 1, False),  # casting every pass, as asked
    (["train.float8=rowwise"], 1, False),
    ([], 1, False),
    (["train.float8=tensorwise", "parallel.backend=deepspeed", "parallel.strategy=zero2"], 1, False),
])
def test_auto_keeps_a_float8_base_where_the_base_is_whole(overrides, world, keeps):
    """peft.base_dtype: auto keeps LoRA's frozen float8 layers as their casts wherever float8: would be accepted
    (the same numbers as casting them every pass); the run and the planner apply one rule."""
    from conftest import ROOT

    from shardtune.config import load_config
    from shardtune.parallel import BACKENDS
    from shardtune.peft import keeps_float8_base
    from shardtune.plan.setting import setting_from_config

    cfg = load_config(str(ROOT / "examples" / "tiny.yaml"), ["peft.method=lora", "train.precision=bf16", *overrides])
    whole = BACKENDS[cfg.parallel.backend].keeps_float8_base(cfg.parallel, world)
    assert keeps_float8_base(cfg.peft, cfg.train.float8, whole=whole) == keeps
    assert setting_from_config(cfg, world, world).base_float8 == keeps
