"""FSDP2 backend: ZeRO-3 / ZeRO-2 with `fully_shard`, and DDP as the unsharded case.

  zero3: parameters, gradients and optimizer states sharded; blocks reshard after forward.
  zero2: the same, but blocks keep their gathered parameters from forward to backward
         (no second all-gather; more memory), like ZeRO-2 / SHARD_GRAD_OP.
  ddp:   full replicas with torch DDP (gradient all-reduce); autocast for mixed precision.

This module holds what the backend runs and refuses, free of torch (`plan` reads it on a login node); the
backend object a run drives is fsdp2_engine.py (direct_engine.py on the one-GPU direct path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardtune.errors import ShardtuneError
from shardtune.parallel.spec import BackendSpec

if TYPE_CHECKING:
    from shardtune.config import Config, ParallelConfig
    from shardtune.dist import DistContext
    from shardtune.parallel.base import LossFn
    from shardtune.parallel.fsdp2_engine import FSDP2Backend


def uses_sharded_scaler(parallel: ParallelConfig, precision: str) -> bool:
    """fp16 under FSDP2 sharding (any strategy but ddp): gradients are shards, so loss scaling goes through
    ShardedGradScaler, whose overflow flag fused AdamW cannot take (see train.optim.use_fused)."""
    return precision == "fp16" and parallel.strategy != "ddp"


def frozen_whole(parallel: ParallelConfig, world: int) -> bool:
    """Whether the frozen compute-dtype weights stay whole on every process, outside FSDP2
    (parallel.shard_frozen; auto: on one process, where sharding them saves nothing and costs a copy per
    block and a gathered root, measured on one H200 (bench/RESULTS.md 2026-12-04, calls 38-40); `world`: every
    process of the job."""
    if parallel.shard_frozen == "auto":
        return world == 1
    return not parallel.shard_frozen


def direct_applies(one_gpu: str, *, world: int, strategy: str, peft: str, precision: str, optim: str,
                   activation_offload: bool, base_dtype: str = "auto") -> bool:
    """Whether zero2 / zero3 run without FSDP2 (parallel.one_gpu = `one_gpu`; `world`: every process of the
    job). auto: only where it was measured to pay (bench/RESULTS.md 2026-12-04, seventeenth and eighteenth
    sessions, one H200, bf16, AdamW: 1B full fine-tuning 7% faster at the same peak; 8B LoRA / QLoRA 4% / 7%
    faster at the same peak); with offloaded activations LoRA / QLoRA only (8B QLoRA at 131,072 tokens on one H100,
    calls 129 and 137: FSDP2's speed, 1.0 GiB less with the input embedding on the host, bench/RESULTS.md
    forty-fourth session); fp32, 8-bit AdamW, an fp32 frozen base and full fine-tuning's offload keep FSDP2."""
    if world != 1 or strategy not in ("zero2", "zero3") or one_gpu == "fsdp2":
        return False
    return one_gpu == "direct" or (precision == "bf16" and optim == "adamw"
                                   and (peft != "none" or not activation_offload)
                                   and (peft == "none" or base_dtype != "fp32"))


def runs_direct(cfg: Config, world: int) -> bool:
    """direct_applies for a run's config."""
    p = cfg.parallel
    return direct_applies(p.one_gpu, world=world, strategy=p.strategy, peft=cfg.peft.method,
                          precision=cfg.train.precision, optim=cfg.optim.name,
                          activation_offload=p.activation_offload, base_dtype=cfg.peft.base_dtype)


def hsdp_shard_size(parallel: ParallelConfig, world: int, per_node: int) -> int:
    """parallel.shard_size (auto = `per_node`, the processes of one node); it must divide the `world`
    processes (every process of the job, all nodes) into equal groups, so a group may span nodes."""
    shard = per_node if parallel.shard_size == "auto" else parallel.shard_size
    if shard > world or world % shard:
        raise ShardtuneError(f"parallel.shard_size: {shard} does not divide the {world} processes into equal groups; "
                             f"choose a divisor of {world} (processes per node is usual), or parallel.strategy=zero3")
    return shard


# ---- what this backend runs, and how `plan` describes it --------------------------------------------

SUPPORTS = {
    "parallel.strategy": ("ddp", "zero2", "zero3", "hsdp"),
    "parallel.offload": ("none",),
    "peft.method": ("none", "lora", "qlora"),
    "optim.name": ("adamw", "adamw8bit"),
    "train.precision": ("fp32", "bf16", "fp16"),
    "parallel.activation_offload": ("false", "true"),
    "parallel.shard_frozen": ("true", "false"),
    "parallel.one_gpu": ("fsdp2", "direct"),
    "train.float8": ("false", "tensorwise", "rowwise"),
    "parallel.tiled_mlp": ("false", "true"),
}
REFUSALS = {
    ("parallel.strategy", "zero1"): "parallel.strategy: zero1 (only optimizer states sharded) has no FSDP2 form; "
                                    "set parallel.backend=deepspeed, or use parallel.strategy=zero2 with fsdp2",
    **{("parallel.offload", offload): f"parallel.offload: {offload} offload is DeepSpeed ZeRO-Offload, which backend "
                                      "fsdp2 does not have; set parallel.backend=deepspeed, or parallel.offload=none"
       for offload in ("optimizer", "params")},
}


def check(cfg: Config, world: int | None = None, device: str | None = None, *, candidate: bool = False,
          per_node: int | None = None) -> None:
    """FSDP2's refusals beyond SUPPORTS (`world`: every process of the job, when known; `per_node`: one node's,
    hsdp's auto group, default `world`)."""
    p = cfg.parallel
    if world is not None and p.strategy == "hsdp":  # a group may span nodes, so it divides the whole job
        hsdp_shard_size(p, world, per_node or world)
    if cfg.optim.fused is True and uses_sharded_scaler(p, cfg.train.precision):
        raise ShardtuneError("optim.fused: true cannot run with train.precision=fp16 under FSDP2 sharding (fused "
                             "AdamW fails on the sharded gradient scaler's overflow flag); set optim.fused=auto "
                             "(foreach AdamW then), or train.precision=bf16")
    check_direct_only(cfg, world)
    if cfg.deepspeed:
        raise ShardtuneError(f"deepspeed: the section is set ({', '.join(cfg.deepspeed)}) but parallel.backend is "
                             "fsdp2, which does not read it; set parallel.backend=deepspeed, or remove the section")
    if cfg.peft.base_dtype == "float8" and (p.strategy == "ddp" or (world is not None and not frozen_whole(p, world))):
        raise ShardtuneError("peft.base_dtype: float8 casts each frozen weight once where the base is whole on each "
                             "GPU outside FSDP2 (zero2 / zero3 / hsdp with parallel.shard_frozen=false, or one "
                             "process); set that, or peft.base_dtype=auto")
    if p.activation_offload and p.strategy == "ddp":
        raise ShardtuneError("parallel.activation_offload: true with parallel.strategy=ddp would move autocast's "
                             "compute-dtype copies of the weights with the activations; set parallel.strategy=zero2 "
                             "or zero3 (one GPU runs them as fast), or parallel.activation_offload=false")
    if p.shard_frozen is False and p.strategy == "ddp":
        raise ShardtuneError("parallel.shard_frozen: false keeps frozen weights out of FSDP2's sharding, which "
                             "parallel.strategy=ddp does not do (every weight is whole); set parallel.strategy=zero2 "
                             "or zero3, or parallel.shard_frozen=true")
    if p.one_gpu == "direct" and cfg.train.precision == "fp16":
        raise ShardtuneError("parallel.one_gpu: direct keeps fp32 masters without a loss scaler; set "
                             "train.precision=bf16, or parallel.one_gpu=fsdp2")
    if p.one_gpu == "direct" and cfg.peft.base_dtype == "fp32" and cfg.train.precision != "fp32":
        raise ShardtuneError("parallel.one_gpu: direct computes with the frozen base as it is stored, and "
                             "peft.base_dtype: fp32 stores it in fp32 (FSDP2 casts it per use); set "
                             "peft.base_dtype=auto, or parallel.one_gpu=fsdp2")


def may_run_direct(cfg: Config, world: int | None) -> bool:
    """Whether the run can land on the one-GPU direct path (`world`: every process of the job, when known; with
    `parallel.strategy: auto` on one process, the planner's pick decides, and its candidates are checked again)."""
    p = cfg.parallel
    if p.strategy in ("ddp", "hsdp") or p.one_gpu == "fsdp2":
        return False
    return world is None or (world == 1 and (p.strategy == "auto" or runs_direct(cfg, world)))


def check_direct_only(cfg: Config, world: int | None) -> None:
    """The settings only the one-GPU direct path runs: optim.fused: compiled (its update) and
    peft.offload_embedding and peft.offload_head (frozen weights on the host), refused in one line elsewhere."""
    if cfg.optim.fused == "compiled" and (cfg.optim.name != "adamw" or cfg.train.precision == "fp16"
                                          or not may_run_direct(cfg, world)):
        raise ShardtuneError("optim.fused: compiled is the update of the one-GPU direct path (one process, "
                             "parallel.strategy zero2 / zero3, parallel.one_gpu auto or direct, AdamW, bf16 or fp32; "
                             "`shardtune plan` says whether a run takes it); set optim.fused=auto")
    if cfg.peft.offload_embedding is True and (cfg.peft.method == "none" or not may_run_direct(cfg, world)):
        raise ShardtuneError("peft.offload_embedding keeps a frozen input embedding on the host on the one-GPU "
                             "direct path (LoRA / QLoRA, one process, parallel.strategy zero2 / zero3, "
                             "parallel.one_gpu auto or direct); set peft.offload_embedding=false")
    if cfg.peft.offload_head is True and (cfg.peft.method == "none" or not may_run_direct(cfg, world)):
        raise ShardtuneError("peft.offload_head keeps a frozen LM head on the host on the one-GPU direct path "
                             "(LoRA / QLoRA, one process, parallel.strategy zero2 / zero3, parallel.one_gpu auto or "
                             "direct); set peft.offload_head=false")


def describe(cfg: Config, world: int, *, per_node: int | None = None) -> str:
    """How FSDP2 runs the strategy (`shardtune plan`); `world`: every process of the job, `per_node`: one node's
    (hsdp's auto group; default `world`)."""
    p = cfg.parallel
    if p.strategy == "ddp":
        return "torch DDP (replicated)"
    if runs_direct(cfg, world):
        update = ""
        if takes_compiled_update(cfg):  # auto takes it on a GPU only
            how = "compiled" if cfg.optim.fused == "compiled" else "auto, on a GPU"
            update = f"; the compiled update (optim.fused: {how})"
        return ("one process without FSDP2: compute-dtype weights in the model, fp32 masters in the optimizer "
                f"(parallel.one_gpu: direct){update}")
    if p.strategy == "hsdp":
        shard = hsdp_shard_size(p, world, per_node or world)
        return (f"FSDP2 hybrid sharding: fully_shard per decoder block on a (replicate {world // shard}, shard "
                f"{shard}) mesh")
    return f"FSDP2 fully_shard(reshard_after_forward={p.strategy == 'zero3'}) per decoder block"


def param_shards(parallel: ParallelConfig, world: int) -> int:
    """ddp keeps whole parameters; the others split them over the world (hsdp within groups of shard_size,
    which divides the world, so what fits `world` shards also fits the groups)."""
    return 1 if parallel.strategy == "ddp" else world



def _make(cfg: Config, ctx: DistContext, loss: LossFn) -> FSDP2Backend:
    from shardtune.parallel.fsdp2_engine import FSDP2Backend

    args = (cfg.parallel, cfg.train.precision, ctx, loss, cfg.optim.max_grad_norm)
    if not runs_direct(cfg, ctx.world):
        return FSDP2Backend(*args)
    from shardtune.parallel.direct_engine import DirectBackend

    on_gpu = ctx.device.type == "cuda"
    return DirectBackend(*args, compiled_update=takes_compiled_update(cfg, on_gpu=on_gpu),
                         offload_embedding=embedding_to_host(cfg, on_gpu=on_gpu),
                         offload_head=cfg.peft.offload_head is True)


def embedding_to_host(cfg: Config, *, on_gpu: bool = True) -> bool | str:
    """peft.offload_embedding as the direct path takes it: true (refused in one line where the model's embedding
    cannot go), "auto" (LoRA / QLoRA on a GPU: to the host where the embedding allows it) or false."""
    value = cfg.peft.offload_embedding
    if value == "auto":
        return "auto" if on_gpu and cfg.peft.method != "none" else False
    return value


def takes_compiled_update(cfg: Config, *, on_gpu: bool = True) -> bool:
    """Whether a run on the one-GPU direct path takes the compiled update (parallel/compiled_adamw.py):
    optim.fused: compiled, or auto where it was measured faster than fused AdamW: AdamW, full fine-tuning in bf16
    with compiled blocks (parallel.compile: true: a run that compiles anyway), one micro-batch a step (the update
    reads the bf16 gradients as backward made them), on a GPU; not with train.float8 (not measured together). The
    1B shape on one H100: +5.3%, +5.1% and +4.6% tokens/s (calls 87, 88 and 92, bench/RESULTS.md), the same peak
    memory and losses to bf16's rounding."""
    if cfg.optim.fused == "compiled":
        return True
    return (cfg.optim.fused == "auto" and cfg.optim.name == "adamw" and cfg.parallel.compile
            and cfg.train.precision == "bf16" and not cfg.train.float8 and cfg.peft.method == "none"
            and cfg.train.grad_accum == 1 and on_gpu)


def keeps_float8_base(parallel: ParallelConfig, world: int) -> bool:
    """The frozen base whole on each GPU outside FSDP2 (the refusal in `check` says where)."""
    return parallel.strategy != "ddp" and frozen_whole(parallel, world)


SPEC = BackendSpec(supports=SUPPORTS, refusals=REFUSALS, make=_make, check=check, describe=describe,
                   checkpoint_format="dcp", param_shards=param_shards, keeps_float8_base=keeps_float8_base)
