"""DeepSpeed and accelerate configs derived from a shardtune config (pure functions, no process group).

deepspeed_config          what shardtune's DeepSpeed backend passes to deepspeed.initialize: concrete values,
                          the user's `deepspeed:` section merged over them.
trainer_deepspeed_config  the same ZeRO / offload settings for Hugging Face Trainer users, with "auto" for
                          every key TrainingArguments fills in (`shardtune plan CONFIG --emit deepspeed`).
trainer_arguments         the TrainingArguments values that match the shardtune config.
accelerate_config         an `accelerate launch --config_file` mapping (`--emit accelerate`).

The `deepspeed:` section may tune anything DeepSpeed has (bucket sizes, overlap_comm, aio, ...). Keys
shardtune derives from its own config (batch sizes, accumulation, clipping, precision, ZeRO stage, offload)
may appear there only with the same value, so no run ever trains with two different answers to one
question; the optimizer and scheduler belong to shardtune (optim.*) and are refused there.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from typing import Any

from shardtune.config import Config, OptimConfig, ParallelConfig, TrainConfig
from shardtune.errors import ConfigError, ShardtuneError

STAGES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}

# DeepSpeed's own defaults (deepspeed/runtime/zero/config.py), written out so the config says what a run uses.
BUCKET_SIZE = 500_000_000
STAGE3 = {
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    # shardtune writes the final model itself (gathered one tensor at a time), never through DeepSpeed's save.
    "stage3_gather_16bit_weights_on_model_save": False,
}
# Loss scaling for fp16: dynamic (loss_scale 0), starting at 2**16, as DeepSpeed documents.
FP16 = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
STEPS_PER_PRINT = 10**12  # shardtune logs its own metrics; DeepSpeed's step log would only interleave with them

# Keys of TrainingArguments' DeepSpeed integration (transformers/integrations/deepspeed.py,
# HfTrainerDeepSpeedConfig.trainer_config_process) that it fills from TrainingArguments and checks against them.
TRAINER_AUTO = (
    ("train_micro_batch_size_per_gpu",),
    ("gradient_accumulation_steps",),
    ("train_batch_size",),
    ("gradient_clipping",),
    ("bf16", "enabled"),
    ("fp16", "enabled"),
)
# ... and those trainer_config_finalize fills from the model's hidden size when they say "auto" (never checked).
TRAINER_HIDDEN_SIZE_AUTO = (
    ("zero_optimization", "reduce_bucket_size"),
    ("zero_optimization", "stage3_prefetch_bucket_size"),
    ("zero_optimization", "stage3_param_persistence_threshold"),
)

_OWNED = {
    ("optimizer",): "deepspeed.optimizer: shardtune builds the optimizer itself and hands it to DeepSpeed "
                    "(optim.name, optim.betas, optim.eps, optim.weight_decay, train.lr); remove the optimizer block "
                    "from the deepspeed section",
    ("scheduler",): "deepspeed.scheduler: shardtune steps its own LR schedule (optim.schedule, optim.warmup_steps, "
                    "optim.warmup_ratio, optim.min_lr_ratio); remove the scheduler block from the deepspeed section",
}
_DEPRECATED = ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory")


def deepspeed_config(parallel: ParallelConfig, train: TrainConfig, optim: OptimConfig, extra: dict, world: int) -> dict:
    """The DeepSpeed config shardtune's DeepSpeed backend passes to deepspeed.initialize (concrete values)."""
    return _build(parallel, train, optim, extra, world, allow_auto=())


def trainer_deepspeed_config(parallel: ParallelConfig, train: TrainConfig, optim: OptimConfig, extra: dict,
                             world: int) -> dict:
    """For Hugging Face Trainer users (`shardtune plan CONFIG --emit deepspeed`): the same ZeRO/offload
    settings, with "auto" for every key TrainingArguments also sets, so TrainingArguments(deepspeed=...)
    never reports 'Please correct the following DeepSpeed config values that mismatch TrainingArguments values'.

    No scheduler block: Trainer steps its own LR schedule from trainer_arguments(). No optimizer block either
    without offload: Trainer then builds torch AdamW (biases and norm weights without weight decay, like
    shardtune). With offload the AdamW step runs on the host, where DeepSpeed's vectorised DeepSpeedCPUAdam
    (what shardtune's own backend uses there) beats torch AdamW (1B, ZeRO-3 + offload, one H200: 5,497 vs
    4,971 tokens/s), so the config names DeepSpeed's AdamW with "auto" parameters, which Trainer fills from
    TrainingArguments.
    """
    cfg = _build(parallel, train, optim, extra, world, allow_auto=TRAINER_HIDDEN_SIZE_AUTO)
    for path in TRAINER_AUTO:
        node = cfg
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = "auto"
    if parallel.offload != "none":
        cfg["optimizer"] = {"type": "AdamW", "params": dict.fromkeys(("lr", "betas", "eps", "weight_decay"), "auto")}
    return cfg


def trainer_arguments(parallel: ParallelConfig, train: TrainConfig, optim: OptimConfig) -> dict:
    """transformers.TrainingArguments keyword arguments matching the shardtune config (pass `deepspeed=` too)."""
    args: dict[str, Any] = {
        "per_device_train_batch_size": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accum,
        "learning_rate": train.lr,
        "bf16": train.precision == "bf16",
        "fp16": train.precision == "fp16",
        "max_grad_norm": optim.max_grad_norm,
        _checkpointing_arg(): parallel.activation_checkpointing != "none",  # HF has no per-op selective mode
        "weight_decay": optim.weight_decay,
        "adam_beta1": optim.betas[0],
        "adam_beta2": optim.betas[1],
        "adam_epsilon": optim.eps,
        # TrainingArguments.warmup_steps: >= 1 counts steps, < 1 is a share of all steps.
        "warmup_steps": optim.warmup_steps if optim.warmup_steps else optim.warmup_ratio,
        "seed": train.seed,
    }
    if optim.schedule == "cosine" and optim.min_lr_ratio > 0:
        args["lr_scheduler_type"] = "cosine_with_min_lr"
        args["lr_scheduler_kwargs"] = {"min_lr_rate": optim.min_lr_ratio}
    elif optim.schedule == "constant":
        args["lr_scheduler_type"] = "constant_with_warmup"
    else:
        args["lr_scheduler_type"] = optim.schedule  # linear: HF's decays to 0 (no min_lr_ratio)
    if train.max_steps is not None:
        args["max_steps"] = train.max_steps
    else:
        args["num_train_epochs"] = train.epochs
    if parallel.compile:
        args["torch_compile"] = True
    return args


def for_trainer(cfg: Config, world: int) -> tuple[dict, str]:
    """`shardtune plan --emit deepspeed`: the config for Hugging Face Trainer and the matching TrainingArguments
    (with notes on what differs), as comment lines for stderr."""
    if cfg.parallel.backend != "deepspeed":
        raise ShardtuneError(f"--emit deepspeed: parallel.backend is {cfg.parallel.backend}; add "
                             "parallel.backend=deepspeed (the config describes a DeepSpeed run)")
    ds = trainer_deepspeed_config(cfg.parallel, cfg.train, cfg.optim, cfg.deepspeed, world)
    kwargs = trainer_arguments(cfg.parallel, cfg.train, cfg.optim)
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    hint = (f"# matching TrainingArguments (launch {world} processes, e.g. torchrun --nproc-per-node {world}):\n"
            f"#   TrainingArguments(output_dir=..., deepspeed='ds_config.json', {args})")
    if cfg.parallel.offload != "none" and cfg.optim.weight_decay > 0:
        hint += ("\n# note: with offload the config names DeepSpeed's AdamW (DeepSpeedCPUAdam), which decays every "
                 "weight, norms and biases too; shardtune and Trainer's own AdamW leave those out")
    if cfg.optim.schedule == "linear" and cfg.optim.min_lr_ratio > 0:
        hint += "\n# note: Trainer's linear schedule decays to 0; optim.min_lr_ratio has no TrainingArguments form"
    return ds, hint


def for_accelerate(cfg: Config, world: int, block_class: Callable[[], str], *,
                   cpu: bool = False) -> tuple[dict, list[str]]:
    """`shardtune plan --emit accelerate`: the accelerate config and notes for stderr. `block_class` names the
    model's decoder block, asked for only when FSDP wraps each block. `cpu`: for a machine without GPUs."""
    p = cfg.parallel
    block = block_class() if p.backend == "fsdp2" and p.strategy != "ddp" else None
    out = accelerate_config(p, cfg.train, world, block, None, max_grad_norm=cfg.optim.max_grad_norm)
    notes = []
    if cpu:
        # use_cpu: false on a machine without GPUs left accelerate to fall back, silently, to one unsharded copy.
        out["use_cpu"] = True
        del out["gpu_ids"]
        if out["distributed_type"] == "MULTI_GPU":
            out["distributed_type"] = "MULTI_CPU"
        sharded = "" if out["distributed_type"] == "MULTI_CPU" else (
            "; accelerate's FSDP and DeepSpeed need GPUs: on CPU it trains one unsharded copy per process "
            "(shardtune train shards on CPU too)")
        notes.append(f"# note: no GPU here, so use_cpu: true{sharded}; --gpu TYPE writes the config for a GPU "
                     "machine")
    if p.backend == "deepspeed" and cfg.deepspeed:
        notes.append("# note: the deepspeed section has no inline accelerate form; use `--emit deepspeed > ds.json` "
                     "and deepspeed_config: {deepspeed_config_file: ds.json}")
    if p.backend == "deepspeed" and p.offload != "none":
        notes.append("# note: with offload, DeepSpeed accepts only its own optimizers unless the config says "
                     "zero_force_ds_cpu_optimizer: false (as `--emit deepspeed` does); use "
                     "deepspeed.ops.adam.DeepSpeedCPUAdam, or that file")
    return out, notes


def _checkpointing_arg() -> str:
    """TrainingArguments' name for activation checkpointing: `activation_checkpointing` in recent transformers
    (`gradient_checkpointing` is its deprecated alias there, with a FutureWarning), else `gradient_checkpointing`."""
    try:
        from transformers import TrainingArguments
    except ImportError:
        return "gradient_checkpointing"
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def accelerate_config(parallel: ParallelConfig, train: TrainConfig, world_per_node: int, block_class: str | None,
                      ds_config_path: str | None, *, max_grad_norm: float | None = None) -> dict:
    """An `accelerate launch --config_file` mapping (accelerate's ClusterConfig keys) for the same strategy.

    backend deepspeed: DEEPSPEED with the ZeRO settings inline (deepspeed_config; gradient_clipping from
    `max_grad_norm`, else accelerate's default), or only a pointer to `ds_config_path` (precision,
    accumulation and clipping then come from that file: accelerate refuses them twice). backend fsdp2: FSDP
    version 2 wrapping each `block_class` (None: the model's _no_split_modules); ddp: MULTI_GPU.
    """
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": "MULTI_GPU",
        "mixed_precision": {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}[train.precision],
        "num_machines": 1,
        "machine_rank": 0,
        "num_processes": world_per_node,
        "gpu_ids": "all",
        "rdzv_backend": "static",
        "same_network": True,
        "main_training_function": "main",
        "enable_cpu_affinity": False,
        "use_cpu": False,
    }
    if parallel.backend == "deepspeed":
        stage = STAGES[parallel.strategy]
        out["distributed_type"] = "DEEPSPEED"
        if ds_config_path is not None:
            del out["mixed_precision"]  # accelerate: "When using `deepspeed_config_file`, ... will be ignored"
            out["deepspeed_config"] = {"deepspeed_config_file": ds_config_path, "zero3_init_flag": stage == 3}
            return out
        nvme = parallel.offload_nvme_path
        device = "nvme" if nvme else "cpu"
        ds: dict[str, Any] = {
            "zero_stage": stage,
            "offload_optimizer_device": device if parallel.offload in ("optimizer", "params") else "none",
            "offload_param_device": device if parallel.offload == "params" else "none",
            "gradient_accumulation_steps": train.grad_accum,
            "zero3_init_flag": stage == 3,
            # accelerate's save_model / get_state_dict under ZeRO-3 need the gathered 16-bit weights.
            "zero3_save_16bit_model": stage == 3,
        }
        if max_grad_norm is not None:
            ds["gradient_clipping"] = float(max_grad_norm)
        if nvme and parallel.offload in ("optimizer", "params"):
            ds["offload_optimizer_nvme_path"] = nvme
            if parallel.offload == "params":
                ds["offload_param_nvme_path"] = nvme
        out["deepspeed_config"] = ds
        return out
    if parallel.strategy == "ddp":
        return out
    if parallel.strategy not in ("zero2", "zero3", "hsdp"):
        raise ConfigError(f"parallel.strategy: {parallel.strategy} has no FSDP2 form; set parallel.backend=deepspeed "
                          "or use parallel.strategy=zero2")
    out["distributed_type"] = "FSDP"
    fsdp: dict[str, Any] = {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": parallel.strategy in ("zero3", "hsdp"),
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_offload_params": False,
        "fsdp_activation_checkpointing": parallel.activation_checkpointing != "none",
    }
    if block_class is not None:
        fsdp["fsdp_transformer_layer_cls_to_wrap"] = block_class
    out["fsdp_config"] = fsdp
    if parallel.strategy == "hsdp":  # accelerate's FSDP2 hybrid sharding: a (replicate, shard) device mesh
        from shardtune.parallel.fsdp2 import hsdp_shard_size

        shard = hsdp_shard_size(parallel, world_per_node, world_per_node)
        out["parallelism_config"] = {"parallelism_config_dp_replicate_size": world_per_node // shard,
                                     "parallelism_config_dp_shard_size": shard}
    return out


# --- the generated config, the keys derived from shardtune's config, and the checked merge ----------------------


def _generated(parallel: ParallelConfig, train: TrainConfig, optim: OptimConfig, world: int) -> dict[str, Any]:
    stage = STAGES[parallel.strategy]
    zero: dict[str, Any] = {"stage": stage}
    if stage >= 1:  # stage 0 is plain data parallelism: no partitioned buckets to overlap or pack
        # Overlapping the gradient reduction with backward pays off only when there is a reduction to hide: on
        # one GPU it only adds a stream and bucket copies (measured on an H200, 1B zero2: 0.93x of HF Trainer +
        # DeepSpeed with it, 1.00x without).
        zero.update(overlap_comm=world > 1, contiguous_gradients=True, reduce_bucket_size=BUCKET_SIZE)
    if stage in (1, 2):
        zero["allgather_bucket_size"] = BUCKET_SIZE
    if stage == 3:
        zero.update(STAGE3)
    if parallel.offload in ("optimizer", "params"):
        zero["offload_optimizer"] = _offload_target(parallel)
    if parallel.offload == "params":
        zero["offload_param"] = _offload_target(parallel)
    return {
        "train_batch_size": train.micro_batch_size * train.grad_accum * world,
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accum,
        "gradient_clipping": float(optim.max_grad_norm),  # 0 disables clipping, as optim.max_grad_norm=0 does
        "bf16": {"enabled": train.precision == "bf16"},
        "fp16": {"enabled": train.precision == "fp16", **FP16},
        "zero_optimization": zero,
        # The backend passes a client torch optimizer (shardtune's AdamW: no weight decay on biases and norms, one
        # LR schedule stepped by shardtune); DeepSpeed only trusts its own optimizers under ZeRO unless told so.
        "zero_allow_untested_optimizer": True,
        # With offload, DeepSpeed by default refuses any client optimizer other than its DeepSpeedCPUAdam (a
        # performance guard, not a correctness one). shardtune hands it torch AdamW unless it is offloading, and
        # the choice of optimizer stays with shardtune (and with Trainer's torch AdamW for --emit deepspeed), so
        # the guard is off: a torch optimizer on offloaded states is slower, never wrong.
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
    }


def _offload_target(parallel: ParallelConfig) -> dict[str, Any]:
    if parallel.offload_nvme_path:
        return {"device": "nvme", "nvme_path": parallel.offload_nvme_path, "pin_memory": True}
    return {"device": "cpu", "pin_memory": True}


def _derived(parallel: ParallelConfig, train: TrainConfig, optim: OptimConfig,
             world: int) -> dict[tuple[str, ...], tuple[Any, str]]:
    """Keys of the DeepSpeed config that shardtune's config decides: path -> (value, which shardtune keys say so)."""
    mbs, accum = train.micro_batch_size, train.grad_accum
    stage = STAGES[parallel.strategy]
    bf16, fp16 = train.precision == "bf16", train.precision == "fp16"
    opt_device = ("nvme" if parallel.offload_nvme_path else "cpu") if parallel.offload != "none" else "none"
    param_device = opt_device if parallel.offload == "params" else "none"
    out: dict[tuple[str, ...], tuple[Any, str]] = {
        ("train_micro_batch_size_per_gpu",): (mbs, f"train.micro_batch_size={mbs}"),
        ("gradient_accumulation_steps",): (accum, f"train.grad_accum={accum}"),
        ("train_batch_size",): (mbs * accum * world, f"train.micro_batch_size x train.grad_accum x processes "
                                                     f"({mbs} x {accum} x {world} = {mbs * accum * world})"),
        ("gradient_clipping",): (float(optim.max_grad_norm), f"optim.max_grad_norm={optim.max_grad_norm}"),
        ("bf16", "enabled"): (bf16, f"train.precision={train.precision} (bf16.enabled {_js(bf16)})"),
        ("fp16", "enabled"): (fp16, f"train.precision={train.precision} (fp16.enabled {_js(fp16)})"),
        ("zero_optimization", "stage"): (stage, f"parallel.strategy={parallel.strategy} (stage {stage})"),
        ("zero_optimization", "offload_optimizer", "device"): (
            opt_device, f"parallel.offload={parallel.offload} (offload_optimizer.device {opt_device})"),
        ("zero_optimization", "offload_param", "device"): (
            param_device, f"parallel.offload={parallel.offload} (offload_param.device {param_device})"),
    }
    if parallel.offload_nvme_path and parallel.offload != "none":
        nvme = (parallel.offload_nvme_path, f"parallel.offload_nvme_path={parallel.offload_nvme_path}")
        out[("zero_optimization", "offload_optimizer", "nvme_path")] = nvme
        if parallel.offload == "params":
            out[("zero_optimization", "offload_param", "nvme_path")] = nvme
    return out


def _build(parallel: ParallelConfig, train: TrainConfig, optim: OptimConfig, extra: dict, world: int,
           allow_auto: tuple[tuple[str, ...], ...]) -> dict[str, Any]:
    if world < 1:
        raise ConfigError(f"processes: {world} is not a number of processes; give 1 or more")
    if not isinstance(extra, dict):
        raise ConfigError(f"deepspeed: must be a mapping of keys, got {extra!r}")
    merged = _merge(_generated(parallel, train, optim, world), extra, _derived(parallel, train, optim, world), ())
    _refuse_auto(merged, (), allow_auto)
    return merged


def _merge(base: dict[str, Any], extra: dict[str, Any], derived: dict[tuple[str, ...], tuple[Any, str]],
           path: tuple[str, ...]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        here = (*path, k)
        key = "deepspeed." + ".".join(here)
        if here in _OWNED:
            raise ConfigError(_OWNED[here])
        if path == ("zero_optimization",) and k in _DEPRECATED:
            raise ConfigError(f"{key}: deprecated DeepSpeed key; shardtune sets offload with parallel.offload "
                              "(none, optimizer, params); remove it from the deepspeed section")
        if here in derived:
            want, source = derived[here]
            if v != "auto" and not _same(v, want):
                raise ConfigError(f"{key}: {_js(v)} conflicts with {source}; set it in one place "
                                  "(remove it from the deepspeed section)")
            out[k] = want
        elif isinstance(base.get(k), dict) or any(d[:len(here)] == here for d in derived):
            if not isinstance(v, dict):
                raise ConfigError(f"{key}: must be a mapping of keys, got {_js(v)}")
            out[k] = _merge(base.get(k) or {}, v, derived, here)
        else:
            out[k] = copy.deepcopy(v)  # a tuning key (or one shardtune does not set): the section wins
    return out


def _refuse_auto(cfg: dict[str, Any], path: tuple[str, ...], allowed: tuple[tuple[str, ...], ...]) -> None:
    for k, v in cfg.items():
        here = (*path, k)
        if isinstance(v, dict):
            _refuse_auto(v, here, allowed)
        elif v == "auto" and here not in allowed:
            raise ConfigError(f"deepspeed.{'.'.join(here)}: 'auto' is filled in by Hugging Face Trainer, not by "
                              "DeepSpeed; give a value or remove it from the deepspeed section")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b


def _js(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
