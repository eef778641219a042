"""The DeepSpeed config shardtune derives (parallel/ds_config.py), the `deepspeed:` section and the backend checks."""

from __future__ import annotations

import sys

import pytest

from shardtune.config import ConfigError, config_from_dict, dump_config, load_config
from shardtune.errors import ShardtuneError
from shardtune.parallel import ds_config
from shardtune.parallel.deepspeed import async_io_available, check_deepspeed_accepts, deepspeed_import_error
from shardtune.parallel.ds_config import accelerate_config, deepspeed_config, trainer_deepspeed_config
from shardtune.validate import check_combination

BASE = {"model": {"preset": "tiny-llama"}, "data": {"train_file": "examples/data/tasks.jsonl"}}


def _cfg(*overrides: str, **raw):
    return config_from_dict({**BASE, **raw}, list(overrides))


def _ds(*overrides: str, world: int = 1, extra: dict | None = None, **raw) -> dict:
    cfg = _cfg("parallel.backend=deepspeed", *overrides, **raw)
    return deepspeed_config(cfg.parallel, cfg.train, cfg.optim, cfg.deepspeed if extra is None else extra, world)


# --- generated values -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy, stage", [("ddp", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3)])
def test_stage_and_buckets_per_strategy(strategy, stage):
    zero = _ds(f"parallel.strategy={strategy}", world=2)["zero_optimization"]
    assert zero["stage"] == stage
    if stage == 0:
        assert zero == {"stage": 0}
        return
    assert zero["overlap_comm"] is True and zero["contiguous_gradients"] is True
    # one process: nothing to overlap, and on an H200 the overlap machinery cost 7% (bench/RESULTS.md)
    assert _ds(f"parallel.strategy={strategy}", world=1)["zero_optimization"]["overlap_comm"] is False
    assert zero["reduce_bucket_size"] == 500_000_000 and isinstance(zero["reduce_bucket_size"], int)
    if stage in (1, 2):
        assert zero["allgather_bucket_size"] == 500_000_000 and isinstance(zero["allgather_bucket_size"], int)
        assert not any(k.startswith("stage3_") for k in zero)
    else:
        assert "allgather_bucket_size" not in zero
        assert zero["stage3_prefetch_bucket_size"] == 50_000_000
        assert zero["stage3_param_persistence_threshold"] == 100_000
        assert zero["stage3_max_live_parameters"] == zero["stage3_max_reuse_distance"] == 1_000_000_000
        assert zero["stage3_gather_16bit_weights_on_model_save"] is False
    assert "offload_optimizer" not in zero and "offload_param" not in zero


def test_batch_clipping_and_fixed_keys():
    ds = _ds("train.micro_batch_size=3", "train.grad_accum=5", "optim.max_grad_norm=0.5", world=4)
    assert ds["train_micro_batch_size_per_gpu"] == 3
    assert ds["gradient_accumulation_steps"] == 5
    assert ds["train_batch_size"] == 3 * 5 * 4
    assert ds["gradient_clipping"] == 0.5
    assert ds["zero_allow_untested_optimizer"] is True
    assert ds["zero_force_ds_cpu_optimizer"] is False
    assert isinstance(ds["steps_per_print"], int) and ds["steps_per_print"] >= 10**9
    assert ds["wall_clock_breakdown"] is False
    assert "optimizer" not in ds and "scheduler" not in ds  # the backend passes a client optimizer and LR schedule
    assert _ds("optim.max_grad_norm=0")["gradient_clipping"] == 0.0


@pytest.mark.parametrize("precision, bf16, fp16",
                         [("bf16", True, False), ("fp16", False, True), ("fp32", False, False)])
def test_precision(precision, bf16, fp16):
    ds = _ds(f"train.precision={precision}")
    assert ds["bf16"] == {"enabled": bf16}
    assert ds["fp16"] == {"enabled": fp16, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                          "hysteresis": 2, "min_loss_scale": 1}


def test_offload(tmp_path):
    zero = _ds("parallel.strategy=zero2", "parallel.offload=optimizer")["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "offload_param" not in zero
    zero = _ds("parallel.offload=params")["zero_optimization"]
    assert zero["offload_optimizer"] == zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    zero = _ds("parallel.offload=params", f"parallel.offload_nvme_path={tmp_path}")["zero_optimization"]
    for block in ("offload_optimizer", "offload_param"):
        assert zero[block] == {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True}
    zero = _ds("parallel.offload=optimizer", f"parallel.offload_nvme_path={tmp_path}")["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "nvme" and "offload_param" not in zero


@pytest.mark.parametrize("overrides", [
    ("parallel.strategy=ddp",),
    ("parallel.strategy=zero1", "train.precision=bf16"),
    ("parallel.strategy=zero2", "parallel.offload=optimizer", "train.precision=fp16"),
    ("parallel.strategy=zero3", "parallel.offload=params", "train.precision=bf16"),
])
def test_deepspeed_parses_every_generated_config(overrides):
    from deepspeed.runtime.config import DeepSpeedConfig

    # world 1: what DeepSpeedConfig checks the batch sizes against outside a process group
    ds = _ds(*overrides, "train.micro_batch_size=2", "train.grad_accum=3")
    parsed = DeepSpeedConfig(ds)
    assert parsed.train_batch_size == 6 and parsed.gradient_accumulation_steps == 3
    assert parsed.zero_optimization_stage == ds["zero_optimization"]["stage"]
    assert parsed.bfloat16_config.enabled == ds["bf16"]["enabled"]
    assert parsed.float16_config.enabled == ds["fp16"]["enabled"]
    offload = parsed.zero_config.offload_optimizer
    device = getattr(offload.device, "value", offload.device) if offload is not None else "none"
    assert device == ("cpu" if any(o.startswith("parallel.offload=") for o in overrides) else "none")


# --- the deepspeed: section -----------------------------------------------------------------------------------------


def test_extra_overrides_tuning_keys_and_adds_new_ones():
    extra = {"zero_optimization": {"reduce_bucket_size": 200_000_000, "overlap_comm": False,
                                   "stage3_max_live_parameters": 5},
             "activation_checkpointing": {"partition_activations": True}, "steps_per_print": 50}
    ds = _ds(extra=extra)
    zero = ds["zero_optimization"]
    assert zero["reduce_bucket_size"] == 200_000_000 and zero["overlap_comm"] is False
    assert zero["stage3_max_live_parameters"] == 5
    assert zero["stage"] == 3 and zero["contiguous_gradients"] is True  # the rest of the generated block stays
    assert zero["stage3_prefetch_bucket_size"] == 50_000_000
    assert ds["activation_checkpointing"] == {"partition_activations": True}
    assert ds["steps_per_print"] == 50
    assert extra["zero_optimization"] == {"reduce_bucket_size": 200_000_000, "overlap_comm": False,
                                          "stage3_max_live_parameters": 5}  # the caller's dict is not changed


def test_extra_may_repeat_derived_keys_with_the_same_value():
    extra = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 16,
             "gradient_clipping": 1, "bf16": {"enabled": True}, "fp16": {"enabled": False, "loss_scale_window": 10},
             "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "buffer_count": 8}}}
    ds = _ds("train.micro_batch_size=4", "train.grad_accum=2", "train.precision=bf16", "parallel.offload=optimizer",
             world=2, extra=extra)
    assert ds["train_batch_size"] == 16 and ds["gradient_clipping"] == 1.0
    assert ds["fp16"]["loss_scale_window"] == 10
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True, "buffer_count": 8}
    auto = _ds(extra={"train_batch_size": "auto", "gradient_clipping": "auto"})  # "auto": shardtune's values
    assert auto["train_batch_size"] == 1 and auto["gradient_clipping"] == 1.0


def test_deepspeed_section_from_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    # Paths beside the file: a dumped config holds them absolute, so the two compare equal.
    path.write_text("model: {preset: tiny-llama}\ndata: {train_file: tasks.jsonl}\ntrain: {output_dir: run}\n"
                    "parallel: {backend: deepspeed}\n"
                    "deepspeed:\n  zero_optimization:\n    reduce_bucket_size: 5e8\n    sub_group_size: 1e9\n")
    cfg = load_config(path, ["deepspeed.zero_optimization.stage3_prefetch_bucket_size=2e7",
                             "deepspeed.steps_per_print=10"])
    # PyYAML reads 5e8 as a string; the free-form section turns exponent notation into numbers.
    assert cfg.deepspeed == {"zero_optimization": {"reduce_bucket_size": 500_000_000, "sub_group_size": 10**9,
                                                   "stage3_prefetch_bucket_size": 20_000_000}, "steps_per_print": 10}
    again = tmp_path / "again.yaml"
    again.write_text(dump_config(cfg))
    assert load_config(again) == cfg
    assert config_from_dict({**BASE, "deepspeed": None}).deepspeed == {}


@pytest.mark.parametrize("raw, overrides, fragment", [
    ({"deepspeed": 3}, [], "deepspeed: must be a mapping"),
    ({"deepspeed": {1: 2}}, [], "deepspeed: key 1 is not a name"),
    ({}, ["deepspeed=3"], "expected section.key=value"),
    ({}, ["deepspeed.=3"], "expected section.key=value"),
    ({}, ["deepspeeed.x=3"], "did you mean 'deepspeed'"),
    ({}, ["train.a.b=1"], "expected section.key=value"),
])
def test_deepspeed_section_errors(raw, overrides, fragment):
    with pytest.raises(ConfigError, match=fragment) as info:
        config_from_dict({**BASE, **raw}, overrides)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("overrides, extra, fragments", [
    (["parallel.strategy=zero3"], {"zero_optimization": {"stage": 2}},
     ["deepspeed.zero_optimization.stage: 2 conflicts with parallel.strategy=zero3 (stage 3)", "set it in one place",
      "remove it from the deepspeed section"]),
    (["train.micro_batch_size=4"], {"train_micro_batch_size_per_gpu": 8},
     ["deepspeed.train_micro_batch_size_per_gpu: 8", "train.micro_batch_size=4"]),
    (["train.grad_accum=2"], {"gradient_accumulation_steps": 1},
     ["deepspeed.gradient_accumulation_steps", "train.grad_accum=2"]),
    (["train.micro_batch_size=4"], {"train_batch_size": 64}, ["deepspeed.train_batch_size: 64", "(4 x 1 x 2 = 8)"]),
    (["optim.max_grad_norm=1.0"], {"gradient_clipping": 0.3},
     ["deepspeed.gradient_clipping: 0.3", "optim.max_grad_norm=1.0"]),
    (["train.precision=fp32"], {"bf16": {"enabled": True}}, ["deepspeed.bf16.enabled: true", "train.precision=fp32"]),
    (["train.precision=bf16"], {"fp16": {"enabled": True}}, ["deepspeed.fp16.enabled: true", "train.precision=bf16"]),
    ([], {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
     ["deepspeed.zero_optimization.offload_optimizer.device: \"cpu\"", "parallel.offload=none"]),
    (["parallel.offload=optimizer"], {"zero_optimization": {"offload_param": {"device": "cpu"}}},
     ["deepspeed.zero_optimization.offload_param.device", "parallel.offload=optimizer"]),
    (["parallel.offload=params"], {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
     ["offload_optimizer.device: \"nvme\"", "parallel.offload=params (offload_optimizer.device cpu)"]),
    ([], {"zero_optimization": {"cpu_offload": True}}, ["deepspeed.zero_optimization.cpu_offload", "parallel.offload"]),
    ([], {"zero_optimization": 3}, ["deepspeed.zero_optimization: must be a mapping"]),
    ([], {"bf16": True}, ["deepspeed.bf16: must be a mapping"]),
    ([], {"zero_optimization": {"reduce_bucket_size": "auto"}},
     ["deepspeed.zero_optimization.reduce_bucket_size: 'auto' is filled in by Hugging Face Trainer"]),
])
def test_conflicts_name_the_key(overrides, extra, fragments):
    with pytest.raises(ConfigError) as info:
        _ds(*overrides, world=2, extra=extra)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_nvme_path_conflict(tmp_path):
    with pytest.raises(ConfigError, match=r"offload_optimizer\.nvme_path: \"/elsewhere\" conflicts with "
                                          r"parallel\.offload_nvme_path="):
        _ds("parallel.offload=optimizer", f"parallel.offload_nvme_path={tmp_path}",
            extra={"zero_optimization": {"offload_optimizer": {"nvme_path": "/elsewhere"}}})


@pytest.mark.parametrize("block, fragment", [("optimizer", "optim.name"), ("scheduler", "optim.schedule")])
def test_optimizer_and_scheduler_blocks_are_refused(block, fragment):
    with pytest.raises(ConfigError) as info:
        _ds(extra={block: {"type": "AdamW", "params": {"lr": 1e-4}}})
    message = str(info.value)
    assert message.startswith(f"deepspeed.{block}: shardtune") and fragment in message and "\n" not in message
    assert f"remove the {block} block" in message


# --- HF Trainer and accelerate forms ---------------------------------------------------------------------------------


def test_trainer_config_is_the_same_with_auto_for_trainer_keys():
    cfg = _cfg("parallel.backend=deepspeed", "parallel.offload=params", "train.precision=bf16",
               deepspeed={"zero_optimization": {"reduce_bucket_size": "auto", "sub_group_size": 10**8}})
    trainer = trainer_deepspeed_config(cfg.parallel, cfg.train, cfg.optim, cfg.deepspeed, 2)
    for path in ds_config.TRAINER_AUTO:
        node = trainer
        for part in path:
            node = node[part]
        assert node == "auto", path
    # hidden-size keys may say "auto" for Trainer (it fills them from the model); not for shardtune's backend
    assert trainer["zero_optimization"]["reduce_bucket_size"] == "auto"
    with pytest.raises(ConfigError, match="reduce_bucket_size: 'auto'"):
        deepspeed_config(cfg.parallel, cfg.train, cfg.optim, cfg.deepspeed, 2)
    concrete = deepspeed_config(cfg.parallel, cfg.train, cfg.optim, {}, 2)
    assert trainer["zero_optimization"]["offload_param"] == concrete["zero_optimization"]["offload_param"]
    assert trainer["zero_optimization"]["stage"] == 3 and trainer["zero_optimization"]["sub_group_size"] == 10**8
    assert "scheduler" not in trainer  # Trainer steps its own schedule
    # With offload the host-side step runs in DeepSpeed's AdamW (DeepSpeedCPUAdam), filled in by Trainer.
    assert trainer["optimizer"] == {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                                "weight_decay": "auto"}}


def test_trainer_arguments_match_the_config():
    cfg = _cfg("train.micro_batch_size=4", "train.grad_accum=2", "train.lr=3e-4", "train.precision=bf16",
               "optim.betas=[0.9, 0.95]", "optim.eps=1e-6", "optim.weight_decay=0.1", "optim.warmup_steps=7",
               "optim.min_lr_ratio=0.1", "parallel.activation_checkpointing=full", "train.max_steps=50")
    args = ds_config.trainer_arguments(cfg.parallel, cfg.train, cfg.optim)
    checkpointing = ds_config._checkpointing_arg()
    assert args == {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "learning_rate": 3e-4,
                    "bf16": True, "fp16": False, "max_grad_norm": 1.0, checkpointing: True, "weight_decay": 0.1,
                    "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_epsilon": 1e-6, "warmup_steps": 7, "seed": 42,
                    "lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
                    "max_steps": 50}
    other = _cfg("optim.schedule=constant", "optim.warmup_ratio=0.1")
    args = ds_config.trainer_arguments(other.parallel, other.train, other.optim)
    assert args["lr_scheduler_type"] == "constant_with_warmup" and args["warmup_steps"] == 0.1
    assert args["num_train_epochs"] == 1 and "max_steps" not in args


def test_accelerate_config_values():
    cfg = _cfg("parallel.backend=deepspeed", "parallel.strategy=zero3", "parallel.offload=params",
               "train.grad_accum=4", "train.precision=bf16")
    out = accelerate_config(cfg.parallel, cfg.train, 8, None, None, max_grad_norm=0.7)
    assert out["distributed_type"] == "DEEPSPEED" and out["num_processes"] == 8 and out["mixed_precision"] == "bf16"
    assert out["deepspeed_config"] == {"zero_stage": 3, "offload_optimizer_device": "cpu",
                                       "offload_param_device": "cpu", "gradient_accumulation_steps": 4,
                                       "zero3_init_flag": True, "zero3_save_16bit_model": True,
                                       "gradient_clipping": 0.7}
    by_file = accelerate_config(cfg.parallel, cfg.train, 8, None, "ds.json")
    assert by_file["deepspeed_config"] == {"deepspeed_config_file": "ds.json", "zero3_init_flag": True}
    assert "mixed_precision" not in by_file  # accelerate refuses it next to a deepspeed_config_file
    fsdp = _cfg("parallel.strategy=zero2", "parallel.activation_checkpointing=full", "train.precision=fp16")
    out = accelerate_config(fsdp.parallel, fsdp.train, 2, "LlamaDecoderLayer", None)
    assert out["distributed_type"] == "FSDP" and out["mixed_precision"] == "fp16"
    assert out["fsdp_config"] == {"fsdp_version": 2, "fsdp_reshard_after_forward": False,
                                  "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                  "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_cpu_ram_efficient_loading": True,
                                  "fsdp_offload_params": False, "fsdp_activation_checkpointing": True,
                                  "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}
    ddp = _cfg("parallel.strategy=ddp", "train.precision=fp32")
    out = accelerate_config(ddp.parallel, ddp.train, 2, None, None)
    assert out["distributed_type"] == "MULTI_GPU" and out["mixed_precision"] == "no"
    assert "fsdp_config" not in out and "deepspeed_config" not in out


# --- check_combination ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, raw, fragments", [
    (["parallel.strategy=zero1"], {}, ["parallel.strategy: zero1", "parallel.backend=deepspeed", "strategy=zero2"]),
    (["parallel.offload=optimizer"], {}, ["parallel.offload: optimizer", "parallel.backend=deepspeed"]),
    (["parallel.backend=deepspeed", "parallel.strategy=zero2", "parallel.offload=params"], {},
     ["parallel.offload: params", "zero3", "parallel.strategy=zero3"]),
    (["parallel.backend=deepspeed", "parallel.strategy=ddp", "parallel.offload=optimizer"], {},
     ["parallel.offload: optimizer", "zero1, zero2 or zero3"]),
    (["parallel.backend=deepspeed", "peft.method=qlora"], {}, ["peft.method: qlora", "parallel.backend=fsdp2"]),
    (["parallel.backend=deepspeed", "optim.name=adamw8bit"], {}, ["optim.name: adamw8bit", "optim.name=adamw"]),
    ([], {"deepspeed": {"steps_per_print": 5}}, ["deepspeed: the section is set (steps_per_print)",
                                                 "parallel.backend=deepspeed"]),
    (["parallel.backend=deepspeed", "parallel.compile=true"], {}, ["parallel.compile", "zero3", "compile=false"]),
    (["parallel.backend=deepspeed", "parallel.offload_nvme_path=/tmp"], {},
     ["parallel.offload_nvme_path: set, but parallel.offload is none"]),
    (["parallel.backend=deepspeed", "parallel.offload=optimizer", "parallel.offload_nvme_path=/no/such/dir"], {},
     ["parallel.offload_nvme_path: '/no/such/dir' does not exist"]),
    (["parallel.backend=deepspeed", "parallel.strategy=zero2", "parallel.offload=optimizer",
      "parallel.offload_nvme_path=/tmp"], {},
     ["parallel.offload_nvme_path: NVMe offload needs parallel.strategy=zero3"]),
    (["parallel.backend=deepspeed"], {"deepspeed": {"zero_optimization": {"stage": 1}}},
     ["deepspeed.zero_optimization.stage: 1 conflicts with parallel.strategy=zero3"]),
    (["parallel.backend=deepspeed", "parallel.strategy=hsdp"], {}, ["parallel.strategy: hsdp", "backend=fsdp2"]),
    (["parallel.shard_size=2"], {}, ["parallel.shard_size: set, but parallel.strategy is zero3"]),
    (["parallel.strategy=hsdp", "parallel.shard_size=4"], {}, ["parallel.shard_size: 4 does not divide the 2"]),
    (["peft.method=lora", "peft.base_dtype=bf16", "train.precision=fp32"], {},
     ["peft.base_dtype: bf16", "train.precision=fp32", "peft.base_dtype=auto"]),
    (["parallel.strategy=zero2", "train.precision=fp16", "optim.fused=true"], {},
     ["optim.fused: true", "train.precision=fp16", "optim.fused=auto"]),
    (["parallel.backend=deepspeed"], {"deepspeed": {"zero_optimization": {"reduce_bucket_sise": 5}}},
     ["deepspeed: DeepSpeed refuses the config", "reduce_bucket_sise", "Extra inputs are not permitted"]),
])
def test_check_combination_refusals(overrides, raw, fragments):
    with pytest.raises(ShardtuneError) as info:
        check_combination(_cfg(*overrides, **raw), world=2)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("overrides", [
    ["parallel.backend=deepspeed", "parallel.strategy=zero1"],
    ["parallel.backend=deepspeed", "parallel.strategy=zero2", "parallel.offload=optimizer", "peft.method=lora"],
    ["parallel.backend=deepspeed", "parallel.strategy=zero3", "parallel.offload=params",
     "parallel.offload_nvme_path=/tmp"],
    ["parallel.backend=deepspeed", "parallel.strategy=ddp", "parallel.compile=true"],
    ["parallel.strategy=zero3", "parallel.compile=true"],
    ["peft.method=lora", "peft.base_dtype=fp32"],
    ["parallel.strategy=hsdp", "parallel.shard_size=2", "peft.method=qlora"],
    ["peft.method=qlora", "peft.base_dtype=bf16", "train.precision=bf16"],
    ["parallel.strategy=ddp", "train.precision=fp16", "optim.fused=true"],
    ["parallel.backend=deepspeed", "parallel.strategy=zero2", "train.precision=fp16", "optim.fused=true"],
])
def test_check_combination_accepts(overrides):
    if any("nvme" in o for o in overrides) and not async_io_available():
        pytest.skip("libaio is not installed here (.ci/run installs it): DeepSpeed's async I/O op cannot build")
    check_combination(_cfg(*overrides), world=2)


def test_nvme_offload_without_libaio_is_refused_with_the_install_command(monkeypatch, tmp_path):
    from shardtune.parallel import deepspeed

    monkeypatch.setattr(deepspeed, "async_io_available", lambda: False)  # a machine without libaio
    with pytest.raises(ShardtuneError) as info:
        check_combination(_cfg("parallel.backend=deepspeed", "parallel.strategy=zero3", "parallel.offload=params",
                               f"parallel.offload_nvme_path={tmp_path}"), world=2)
    assert "apt-get install libaio-dev" in str(info.value) and "\n" not in str(info.value)


def test_missing_deepspeed_is_refused_with_the_install_command(monkeypatch):
    deepspeed_import_error.cache_clear()
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` raises ImportError
    try:
        with pytest.raises(ShardtuneError) as info:
            check_combination(_cfg("parallel.backend=deepspeed"), world=1)
    finally:
        deepspeed_import_error.cache_clear()
    message = str(info.value)
    assert "import deepspeed failed" in message and "pip install -e '.[deepspeed]'" in message
    assert "\n" not in message


def test_a_planner_candidate_is_checked_without_importing_deepspeed(monkeypatch):
    """`plan` prices DeepSpeed candidates for every config: asking only whether the package is installed keeps
    `import deepspeed` (~5 s) out of it, also with a `deepspeed:` section, which DeepSpeed's own parser reads in
    the full check (validate, the launch)."""
    import importlib.util

    from shardtune.parallel import check_combination as parallel_check

    cfg = _cfg("parallel.backend=deepspeed", "parallel.strategy=zero3")
    imported = []
    monkeypatch.setattr("shardtune.parallel.deepspeed.deepspeed_import_error", lambda: imported.append(1))
    parallel_check(cfg, 2, candidate=True)
    assert imported == []
    parallel_check(cfg, 2)  # the run that takes it: the import is checked
    assert imported == [1]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(ShardtuneError, match=r"deepspeed needs the deepspeed package \(not installed\); pip install"):
        parallel_check(cfg, 2, candidate=True)
    with_section = _cfg("parallel.backend=deepspeed", "parallel.strategy=zero3",
                        deepspeed={"zero_optimization": {"reduce_bucket_sise": 5}})
    monkeypatch.undo()
    parallel_check(with_section, 2, candidate=True)
    with pytest.raises(ShardtuneError, match="reduce_bucket_sise"):  # DeepSpeed's parser refuses the misspelt key
        parallel_check(with_section, 2)


def test_deepspeed_accepts_probe_uses_world_of_one():
    check_deepspeed_accepts(_ds(world=8, extra={}))  # train_batch_size 8 would fail DeepSpeed's world-1 check as is


def test_fused_adamw_is_left_out_only_for_sharded_fp16():
    """fp16 under FSDP2 sharding: the sharded gradient scaler's overflow flag breaks fused AdamW (found on a GPU,
    reproduced on CPU with optim.fused=true), so auto takes foreach AdamW there and the fused kernel elsewhere, on
    CPUs too (3-4x faster there than foreach under FSDP2)."""
    import torch

    from shardtune.train.optim import use_fused

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert use_fused(_cfg().optim, gpu, sharded_fp16=False)
    assert not use_fused(_cfg().optim, gpu, sharded_fp16=True)
    assert use_fused(_cfg().optim, cpu, sharded_fp16=False)
    assert not use_fused(_cfg().optim, cpu, sharded_fp16=True)
    assert not use_fused(_cfg("optim.fused=false").optim, cpu, sharded_fp16=False)
